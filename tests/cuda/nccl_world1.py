"""One process, one GPU, NCCL: ``ZeroOptimizer`` (bf16 parameters) against ``AdamW(fused=True)``.

    python tests/cuda/nccl_world1.py PORT        # prints one JSON line

The reference keeps fp32 masters of the bf16 parameters and steps them with
``torch.optim.AdamW(fused=True)`` on the bf16 gradients made fp32, then rounds
them into the model: what ``ZeroOptimizer`` does at world 1, where every
reduction is a copy. Both step elementwise with the same kernel, so the
parameters are expected bit-identical.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of

STEPS = 5


def main(port: int) -> dict[str, object]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", device_id=device
    )
    task = SortTask()
    config = GPTConfig(vocab=task.vocab, context=task.context)
    model = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
    reference = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
    hyper = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, **hyper)
    masters = [p.detach().float().clone() for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(masters, **hyper)
    losses, ref_losses = [], []
    for step in range(STEPS):
        tokens, targets = (t.to(device) for t in task.batch(step=step, rank=0, size=8))
        loss = loss_of(model, tokens, targets)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(reference, tokens, targets)
        ref_loss.backward()
        for master, p in zip(masters, reference.parameters(), strict=True):
            master.grad, p.grad = p.grad.float(), None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, reference.parameters(), strict=True):
                p.copy_(master)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    differing = [
        name
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    max_abs = max(
        float((a.float() - b.float()).abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )
    dist.destroy_process_group()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "differing": differing,
        "max_abs": max_abs,
        "device": torch.cuda.get_device_name(device),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
