"""In-process step times of pythia-14m: eager, compiled blocks (as training compiles), or the whole model.

    OMP_NUM_THREADS=1 python benchmarks/compile_steps.py pretrain|lora eager|compile|whole fp32|bf16

pretrain: micro-batch 4 x 512 tokens; lora: peft LoRA on query and value, micro-batch 4 of random
lengths 200-500 (dynamic shapes). 12 forward/backward/AdamW steps; the mean of steps 4-12 is the
figure ("steady"); compile time and the first step are printed apart. Run the modes alternately and
record the load average: see tutorials/compile.md.
"""
import time, sys, random, torch
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, Block
from toolkit.parallel.compile import compile_blocks, compile_seconds
torch.manual_seed(0)
kind, mode, prec = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = Config.from_name("pythia-14m")
m = GPT(cfg)
if kind == "lora":
    from peft import get_peft_model
    from toolkit.models.adapters import LoRAArgs
    m = get_peft_model(m, LoRAArgs().peft_config())
if mode == "whole":
    m = torch.compile(m)
if mode == "compile":
    compile_blocks(m, Block, torch.device("cpu"), dynamic=(kind == "lora"), print_fn=print)
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
rng = random.Random(0)
times, c0 = [], compile_seconds()
for i in range(12):
    T = 512 if kind == "pretrain" else rng.randint(200, 500)
    ids = torch.randint(0, cfg.vocab_size, (4, T))
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16"):
        loss = m(ids, labels=ids)
    loss.backward(); opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t)
steady = times[3:]
print(f"{kind} {mode} {prec}: steady {sum(steady)/len(steady):.3f} s/step (min {min(steady):.3f}), compile {compile_seconds()-c0:.1f} s, first {times[0]:.1f} s")
