"""tests/deploy: the Dockerfiles, .dockerignore, docker-compose.yml and `draftmesh health`.

No Docker engine is needed (there is none on the dev and CI machines): the files are parsed and
checked against the repository (Makefile pins, pyproject, the real CLI parsers and configs, the
Compose JSON schema), and the health command runs against an in-process gRPC server."""
