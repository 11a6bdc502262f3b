"""Hugging Face transformers greedy generation with a KV cache, for hiber's GPU suite.

A GPT-2 model of random weights from a fixed seed (nothing is downloaded) decodes greedily,
one token per step, feeding back the cache the model returns (`past_key_values`), as a
serving loop does. Prints `step N checksum X t MS token T` per step, X being a running
hash of every token so far: a restored run must produce the uninterrupted run's tokens.
At the end it checks --extra-gib of device memory word by word.
"""
import argparse
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--extra-gib", type=float, default=1.0)
args = p.parse_args()

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402
import transformers  # noqa: E402

torch.manual_seed(1234)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
config = transformers.GPT2Config(vocab_size=8192, n_positions=1024, n_embd=512, n_layer=6, n_head=8)
model = transformers.GPT2LMHeadModel(config).to(dev).eval()
extra = torch.arange(int(args.extra_gib * (1 << 30) // 8), device=dev, dtype=torch.int64)
tokens = torch.tensor([[11, 22, 33, 44, 55, 66, 77, 88]], device=dev)
print(f"start generate steps {args.steps} pid {os.getpid()} transformers {transformers.__version__}", flush=True)
h = 0
with torch.no_grad():
    out = model(input_ids=tokens, use_cache=True)
    past = out.past_key_values
    for step in range(args.steps):
        nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        tok = int(nxt.item())
        h = (h * 1000003 + tok + 1) % (1 << 32)
        print(f"step {step} checksum {h:08x} t {int(time.time() * 1000)} token {tok}", flush=True)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        time.sleep(args.interval_ms / 1000)
ok = bool(torch.equal(extra, torch.arange(extra.numel(), device=dev, dtype=torch.int64)))
print("verify ok extra memory intact" if ok else "verify FAILED extra memory", flush=True)
raise SystemExit(0 if ok else 1)
