"""The single-process reference: a bare PyTorch loop with no parallelism at all.

It is the ground truth of loss parity (every N-D layout is compared with it directly, on the
same weights, global batch and token order) and the baseline of the trainer's overhead
benchmark. It shares only the model, the data loader and the LR shape with the trainer.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from core import cpu_gemm
from core.build import with_attention_dtype
from core.config import JobConfig
from core.data.datasets import build_dataloader
from core.data.tokenizer import Tokenizer
from core.models.args import model_args  # the same ModelArgs resolution as the trainer
from core.models.llama3 import create_model
from core.optim import ADAM_KERNELS, lr_factor


def reference_run(
    cfg: JobConfig,
    vocab_size: int | None = None,
    steps: int | None = None,
    batches=None,
    bf16: str = "autocast",
    adamw: str = "foreach",
) -> dict:
    """Train cfg's model in this process on the global batch of cfg's layout.

    `batches`: an iterable of (inputs, labels) global batches; by default the trainer's data
    loader at dp degree 1 with local batch = dp x local batch (the same global batch).
    `bf16` (when training.mixed_precision_param is bfloat16): "autocast" as the trainer runs
    without FSDP, or "params" as FSDP2's mixed precision does (forward and backward with bf16
    copies of the fp32 parameters, fp32 gradients and update).
    `adamw`: AdamW's kernels, as `optimizer.implementation` names them (foreach by default).
    bf16 matmuls run as `training.bf16_gemm` resolves on this CPU, as in the trainer's ranks.
    Returns {"losses", "step_times_s", "grad_norms" (before clipping), "tokens_per_step"}.
    """
    gemm = cpu_gemm.resolve(cfg.training.bf16_gemm, torch.device("cpu"), cfg.training.mixed_precision_param)
    with cpu_gemm.using(gemm):
        return _reference_loop(cfg, vocab_size, steps, batches, bf16, adamw)


def _reference_loop(cfg: JobConfig, vocab_size, steps, batches, bf16: str, adamw: str) -> dict:
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    steps = steps or t.steps
    dp = cfg.parallelism.dp_replicate * max(cfg.parallelism.dp_shard, 1)
    torch.manual_seed(cfg.job.seed)
    tokenizer = None
    if cfg.data.dataset != "synthetic":
        tokenizer = Tokenizer(cfg.tokenizer.path)
    args = with_attention_dtype(
        model_args(cfg, tokenizer.n_words if tokenizer else vocab_size), cfg, torch.device("cpu")
    )
    model = create_model(args, device="cpu")  # from the seed: the weights every layout starts from
    if batches is None:
        batches = build_dataloader(
            cfg, tokenizer, dp_rank=0, dp_degree=1, vocab_size=args.vocab_size, local_batch_size=t.local_batch_size * dp
        )
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        **ADAM_KERNELS[adamw],
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: lr_factor(k, s.warmup_steps, t.steps, s.decay_type, s.min_lr_factor)
    )
    use_bf16 = t.mixed_precision_param == "bfloat16"
    bf16_params = use_bf16 and bf16 == "params"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16 and not bf16_params)
    losses, times, norms = [], [], []
    it = iter(batches)
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        total = 0.0
        for _ in range(t.grad_accum_steps):
            inputs, labels = next(it)
            with autocast:
                if bf16_params:  # the cast is differentiable: grads arrive in fp32, like FSDP2's
                    logits = torch.func.functional_call(
                        model, {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}, (inputs,)
                    )
                else:
                    logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)) / t.grad_accum_steps
            loss.backward()
            total += loss.item()
        if t.max_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)))
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(total)
    return {
        "losses": losses,
        "step_times_s": times,
        "grad_norms": norms,
        "tokens_per_step": t.local_batch_size * dp * t.seq_len * t.grad_accum_steps,
    }
