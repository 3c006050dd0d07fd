"""A stand-in for bench/vllm_worker.py in tests: the same protocol and command line, greedy
decoding by transformers' ``generate`` on the model folder (so its tokens equal our plain's)
instead of vLLM. Started by a fake ``python`` (see test_vllm_runner.py) as
``fake_vllm_worker.py -P <vllm_worker.py> --model DIR --dtype D --max-model-len N``.

Behaviour switches, by environment: FAKE_VLLM_FLIP=K changes the K-th generated token (and
stops there), FAKE_VLLM_START=crash exits before ready, FAKE_VLLM_START=garbage writes a line
that is not JSON, FAKE_VLLM_CHILD=PATH starts a child process that sleeps (like vLLM's engine core) and
writes the pids of both to PATH,
FAKE_VLLM_FAIL_ID=X answers request X with an error.
"""

import argparse
import json
import os
import subprocess
import sys
import time

assert sys.argv[1] == "-P" and sys.argv[2].endswith("vllm_worker.py"), sys.argv
parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--dtype", required=True)
parser.add_argument("--max-model-len", type=int, required=True)
parser.add_argument("--speculative-config", default=None)
parser.add_argument("--eager", action="store_true")
args = parser.parse_args(sys.argv[3:])
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

start = os.environ.get("FAKE_VLLM_START")
if start == "crash":
    print("fake vllm: cannot load the model", file=sys.stderr)
    sys.exit(3)
if start == "garbage":
    out.write("INFO this is not json\n")
    out.flush()
    time.sleep(30)
if os.environ.get("FAKE_VLLM_CHILD"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.environ["FAKE_VLLM_CHILD"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
out.write(json.dumps({"event": "ready", "load_s": 0.1, "vllm": "fake", "pid": os.getpid(), "eager": args.eager,
                      "speculative_config": json.loads(args.speculative_config) if args.speculative_config else None,
                      "child": child.pid if os.environ.get("FAKE_VLLM_CHILD") else None}) + "\n")
out.flush()
flip = int(os.environ.get("FAKE_VLLM_FLIP", "-1"))
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "exit":
        break
    if msg["id"] == os.environ.get("FAKE_VLLM_FAIL_ID"):
        out.write(json.dumps({"event": "error", "id": msg["id"], "message": "ValueError: fake failure"}) + "\n")
        out.flush()
        continue
    ids = torch.tensor([msg["prompt_ids"]])
    t0 = time.perf_counter()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=msg["max_new_tokens"], eos_token_id=msg["stop_token_ids"] or None,
                           pad_token_id=0)
    with torch.inference_mode():
        new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, ids.shape[1]:].tolist()
    if 0 <= flip < len(new):
        new = new[:flip] + [(new[flip] + 1) % model.config.vocab_size]
    out.write(json.dumps({"event": "result", "id": msg["id"], "token_ids": new, "seconds": time.perf_counter() - t0,
                          "finish_reason": "length"}) + "\n")
    out.flush()
