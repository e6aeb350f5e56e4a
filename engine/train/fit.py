"""Fit a draft head: the EAGLE-3 training-time test (TTT) unroll, or the EAGLE-1 regression + token loss.

TTT (spec section 5.4): slot j first reads the target features after token j and the token j+1; at unroll step s
the same slot reads its own previous output and the token j+s+1, at position j+s, and must predict the target's
distribution for token j+s+2. Its attention sees the step-0 keys of slots <= j and, of each later step, only its
own slot -- exactly what a depth-s node of an inference tree sees. Tokens are teacher-forced; the hidden state is
the head's own, so the head learns to cope with its own errors.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from ..draft.checkpoint import save_head
from ..draft.head import DraftHead
from ..flags import flag
from ..progress import progress_bar
from ..model.packed import PackedLinear
from ..model.quant import QuantLinear


KEEP_CHECKPOINTS = 2  # whole checkpoints kept: the newest, and the one before in case the disk fills while saving


@dataclass
class FitConfig:
    """How a head is fitted; each field with a flag is a `python -m engine.train fit` option (engine.flags)."""

    ttt_steps: int = field(default=7, metadata=flag(  # the paper's 7; EAGLE-1 always uses 1
        "--ttt-steps", "EAGLE-3 training-time-test unroll", type=int))
    step_decay: float = 0.8  # weight of unroll step s is decay**s
    lr: float = field(default=1e-3, metadata=flag("--lr", "peak learning rate", type=float))
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup: int = field(default=50, metadata=flag("--warmup", "warm-up steps", type=int))
    epochs: float = field(default=1.0, metadata=flag("--epochs", "passes over the training records", type=float))
    batch_tokens: int = field(default=4096, metadata=flag(
        "--batch-tokens", "padded tokens per step (per process)", type=int))
    weight_decay: float = 0.0
    clip: float = field(default=0.5, metadata=flag("--clip", "gradient-norm clipping", type=float))
    feature_noise: float = field(default=0.0, metadata=flag(
        "--feature-noise", "EAGLE-1 only: uniform noise amplitude added to input features", type=float))
    train_lm_head: bool = field(default=False, metadata=flag(
        "--train-lm-head", "EAGLE-3: train the draft LM head too (default: keep it at the base model's rows, "
        "cheaper and faster to learn)", action="store_true"))
    align_topk: int = field(default=0, metadata=flag(
        "--align-topk", "EAGLE-3: leave a slot out of later TTT steps' loss once its guess misses the target's "
        "top-k (GRIFFIN's mask; 0 = off)", type=int))
    save_every: int = field(default=200, metadata=flag("--save-every", "checkpoint period in steps", type=int))
    eval_every: int = field(default=200, metadata=flag("--eval-every", "validation period in steps", type=int))
    seed: int = field(default=0, metadata=flag("--seed", "batch order and noise", type=int))


def bf16_supported() -> bool:
    """bf16 autocast pays off on CPUs with native bf16 (AVX-512 BF16 / AMX) and on recent GPUs."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def plan_batches(lengths: list[int], batch_tokens: int, epoch: int, seed: int) -> list[list[int]]:
    """One epoch of batches: records of similar length together (little padding), batch order shuffled per epoch."""
    rng = random.Random(seed * 1000003 + epoch)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, current, width = [], [], 0
    for i in order:
        width_if_added = max(width, lengths[i])
        if current and width_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width_if_added = [], lengths[i]
        current.append(i)
        width = width_if_added
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def ttt_masks(length: int, steps: int, device=None) -> list[torch.Tensor]:
    """Boolean attention masks [1, 1, T, (s+1)·T] for unroll steps s = 0..steps-1 (True = visible).

    Step 0 is causal over the target-fed slots; each later step adds one block in which slot j sees only itself.
    """
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return [torch.cat([causal] + [eye] * s, dim=1)[None, None] for s in range(steps)]


def _shift(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, j + by] at column j, `fill` past the end."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


def ttt_unroll(head: DraftHead, features: torch.Tensor, ids: torch.Tensor, steps: int):
    """Yield the head's outputs [B, T, H] for unroll steps s = 0..steps-1 (slot j at step s reads token j+s+1)."""
    device = head.fc.weight.device
    length = ids.shape[1]
    masks = ttt_masks(length, steps, device)
    hidden, past = features.to(device), None
    for s in range(steps):
        tokens = _shift(ids, s + 1).to(device)
        positions = (torch.arange(length, device=device) + s).expand(ids.shape[0], -1)
        out, kv = head(hidden, tokens, positions, past, masks[s], from_target=s == 0)
        past = kv if past is None else [(torch.cat([p[0], k[0]], 2), torch.cat([p[1], k[1]], 2))
                                        for p, k in zip(past, kv)]
        yield out
        hidden = out


def eagle3_loss(head: DraftHead, batch: dict, target_head: torch.Tensor, steps: int, decay: float,
                align_topk: int = 0):
    """TTT loss and, per step, (correct greedy guesses, counted slots, chain-prefix correct).

    target_head: the base LM-head rows of the draft vocabulary [V_d, H] (target distribution = softmax(last @ it.T)).
    The LM head and softmaxes run only on the slots that count (reply tokens): they are most of a step's work.
    align_topk > 0 masks misaligned slots as GRIFFIN does: once a slot's greedy guess at some step is not among the
    target's top-k tokens (of the draft vocabulary), verification would have cut its chain there, so what the
    later steps predict from it is left out of their loss.
    """
    reply, top1 = batch["reply"], batch.get("top1")  # top1 is optional: training steps skip its full-vocab matmul
    device = head.fc.weight.device
    target_logits = batch["last"].to(device, target_head.dtype) @ target_head.T  # predicts token p+1 at p
    in_vocab = head.t2d[top1.to(device)] if head.has_vocab_map and top1 is not None else torch.ones_like(reply)
    total = torch.zeros((), device=device)
    stats, prefix = [], None
    aligned = torch.ones_like(reply, device=device)
    for s, out in enumerate(ttt_unroll(head, batch["features"], batch["input_ids"], steps)):
        # slot j at step s predicts token j+s+2 from the target's distribution at position j+s+1
        counted = _shift(reply, s + 2, False).to(device)
        learn = (_shift(in_vocab, s + 1, False).to(device) & aligned)[counted]  # among the counted slots
        logits = head.logits(out[counted]).float()
        step_logits = _shift(target_logits, s + 1)[counted].float()
        per_slot = -(F.softmax(step_logits, -1) * F.log_softmax(logits, -1)).sum(-1)
        total = total + decay**s * per_slot[learn].sum() / learn.sum().clamp(min=1)
        if align_topk:
            with torch.no_grad():
                guessed = (step_logits.topk(align_topk, -1).indices == logits.argmax(-1, keepdim=True)).any(-1)
                aligned[counted] &= guessed
        if top1 is not None:
            with torch.no_grad():
                correct = torch.zeros_like(counted)
                correct[counted] = head.to_target(logits.argmax(-1)) == _shift(top1, s + 1).to(device)[counted]
                prefix = correct if prefix is None else prefix & correct
                stats.append((correct.sum().item(), counted.sum().item(), prefix.sum().item()))
    return total, stats


def eagle1_loss(head: DraftHead, batch: dict, noise: float, generator: torch.Generator | None):
    """Smooth-L1 regression on the next feature plus cross-entropy against the target's next-token distribution."""
    device = head.fc.weight.device
    ids, reply, top1 = batch["input_ids"], batch["reply"], batch["top1"]
    length = ids.shape[1]
    features = batch["features"].to(device).float()
    if noise > 0:
        features = features + (torch.rand(features.shape, generator=generator) - 0.5).to(device) * 2 * noise
    positions = torch.arange(length, device=device).expand(ids.shape[0], -1)
    out, _ = head(features, _shift(ids, 1).to(device), positions, None, ttt_masks(length, 1, device)[0], True)
    pred, want = out[:, : length - 2].float(), features[:, 1 : length - 1]
    counted = reply[:, 2:].to(device)
    regression = F.smooth_l1_loss(pred, want, reduction="none").mean(-1)[counted].mean()
    logits = head.logits(pred).float()
    with torch.no_grad():
        target = F.softmax(head.logits(want).float(), -1)
    token = -(target * F.log_softmax(logits, -1)).sum(-1)[counted].mean()
    with torch.no_grad():
        correct = (logits.argmax(-1) == top1[:, 1 : length - 1].to(device)) & counted
        stats = [(correct.sum().item(), counted.sum().item(), correct.sum().item())]
    return regression + 0.1 * token, stats


def target_rows(head: DraftHead, base_model) -> torch.Tensor | None:
    """The base LM-head rows of the draft vocabulary [V_d, H], for the EAGLE-3 target distribution; None for EAGLE-1."""
    if head.kind != "eagle3":
        return None
    weight = linear_weight(base_model.get_output_embeddings())
    return (weight[head.t2d] if head.has_vocab_map else weight).clone()


@torch.no_grad()
def linear_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The float32 weight [out, in] a linear layer computes with, whatever the engine made of it: a grouped layer's
    dequantized groups; a packed layer's read back through the layer (oneDNN keeps only its blocked copy), whose
    product with the identity is the weight exactly; else the weight itself."""
    if isinstance(layer, QuantLinear):
        return layer.dequantized()
    if isinstance(layer, PackedLinear):
        eye = torch.eye(layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)
        product = layer(eye) if layer.bias is None else layer(eye) - layer.bias
        return product.T.float()
    return layer.weight.detach().float()


@torch.no_grad()
def norm_scale(norm: torch.nn.Module, width: int) -> torch.Tensor:
    """The per-channel scale an RMSNorm applies, read from its output on a row of ones (to within its epsilon):
    `weight` for most models, `1 + weight` for Gemma's."""
    weight = norm.weight
    return norm(torch.ones(1, width, dtype=weight.dtype, device=weight.device))[0].float()


def init_from_base(head: DraftHead, base_model, rows: torch.Tensor | None) -> None:
    """Start a new EAGLE-3 head where the base model ends, so a short run does not spend its steps finding it.

    The LM head copies `rows` (target_rows: the base LM-head rows of the draft vocabulary), the final norm scales
    as the base model's does, and the fused-feature projection passes the highest fused layer through unchanged:
    the head's first guess is the base model's own late-layer prediction. EAGLE-1 heads (rows None) stay as they
    are.
    """
    if head.kind != "eagle3":
        return
    with torch.no_grad():
        head.lm_head.weight.copy_(rows)
        norm = getattr(base_model.get_decoder(), "norm", None)
        if norm is not None:
            head.norm.weight.copy_(norm_scale(norm, head.norm.weight.shape[0]))
        hidden = head.fc.weight.shape[0]
        if head.fc.weight.shape[1] == 3 * hidden:
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * hidden:] = torch.eye(hidden)


def summarise(stats: list[list[tuple[int, int, int]]]) -> dict:
    """Per-step accuracy, conditional acceptance, and the expected accepted length of a greedy draft chain."""
    steps = len(stats[0])
    sums = [[sum(batch[s][k] for batch in stats) for k in range(3)] for s in range(steps)]
    accuracy = [c / n if n else 0.0 for c, n, _ in sums]
    prefix = [p / n if n else 0.0 for _, n, p in sums]
    conditional = [prefix[0]] + [prefix[s] / prefix[s - 1] if prefix[s - 1] else 0.0 for s in range(1, steps)]
    return {"accuracy": accuracy, "acceptance": conditional, "chain_tau": 1 + sum(prefix)}


class Objective(torch.nn.Module):
    """The head and its loss as one module, so one forward = one training step (what DDP needs)."""

    def __init__(self, head: DraftHead, target_head: torch.Tensor | None, config: FitConfig):
        super().__init__()
        self.head, self.config = head, config
        self.register_buffer("target_head", target_head, persistent=False)

    def forward(self, batch: dict, step: int):
        if self.head.kind == "eagle3":
            # validation keeps every slot, so its loss compares across align_topk settings
            align = self.config.align_topk if self.training else 0
            return eagle3_loss(self.head, batch, self.target_head, self.config.ttt_steps, self.config.step_decay, align)
        generator = torch.Generator().manual_seed(self.config.seed * 7919 + step)
        return eagle1_loss(self.head, batch, self.config.feature_noise, generator)


class Trainer:
    """Owns the head, optimiser, schedule and the resumable loop; features come from a Cached/LiveFeatures source.

    A new head (`from_base=True`) starts where the base model ends; `from_base=False` trains on from the weights
    the head has (fine-tuning a trained head on new data).
    """

    def __init__(self, head: DraftHead, base_model, source, train_idx: list[int], val_idx: list[int],
                 config: FitConfig, out: str | Path, accelerator: Accelerator | None = None, from_base: bool = True):
        self.config, self.out = config, Path(out)
        self.accelerator = accelerator or Accelerator(mixed_precision="bf16" if bf16_supported() else "no",
                                                      cpu=not torch.cuda.is_available())
        self.source, self.train_idx, self.val_idx = source, train_idx, val_idx
        head.train().requires_grad_(True)
        head.attach(base_model)
        rows = target_rows(head, base_model)
        if from_base:
            init_from_base(head, base_model, rows)
        objective = Objective(head, rows, config)
        if head.kind == "eagle3" and not config.train_lm_head:
            head.lm_head.requires_grad_(False)
        lengths = [len(source.records[i]["input_ids"]) for i in train_idx]
        self.epoch_batches = len(plan_batches(lengths, config.batch_tokens, 0, config.seed))
        self.total_steps = max(1, math.ceil(self.epoch_batches * config.epochs))
        params = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        self.objective, self.optimizer, self.scheduler = self.accelerator.prepare(objective, optimizer, scheduler)
        self.step = 0
        self.history: list[dict] = []

    def _lr_factor(self, step: int) -> float:
        c = self.config
        if step < c.warmup:
            return (step + 1) / c.warmup
        progress = min(1.0, (step - c.warmup) / max(1, self.total_steps - c.warmup))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def unwrapped(self) -> DraftHead:
        return self.accelerator.unwrap_model(self.objective).head

    def batch_for(self, step: int) -> list[int]:
        """The records of global step `step` for this process; a pure function of (seed, step), so resume is exact."""
        epoch, index = divmod(step, self.epoch_batches)
        lengths = [len(self.source.records[i]["input_ids"]) for i in self.train_idx]
        if getattr(self, "_planned_epoch", None) != epoch:
            tokens_per_batch = self.config.batch_tokens * self.accelerator.num_processes
            self._plan = plan_batches(lengths, tokens_per_batch, epoch, self.config.seed)
            self._planned_epoch = epoch
        batch = self._plan[index % len(self._plan)]
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        return [self.train_idx[i] for i in batch[rank::world]] or [self.train_idx[batch[0]]]

    def train_step(self) -> float:
        batch = self.source.batch(self.batch_for(self.step), with_top1=self.unwrapped.kind != "eagle3")
        with self.accelerator.autocast():
            loss, stats = self.objective(batch, self.step)
        self.accelerator.backward(loss)
        if self.config.clip:
            self.accelerator.clip_grad_norm_(self.objective.parameters(), self.config.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        return loss.item()

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        if not self.val_idx:
            return None
        self.objective.eval()
        lengths = [len(self.source.records[i]["input_ids"]) for i in self.val_idx]
        stats, losses = [], []
        for group in plan_batches(lengths, self.config.batch_tokens, 0, 0):
            batch = self.source.batch([self.val_idx[i] for i in group])
            with self.accelerator.autocast():
                loss, batch_stats = self.objective(batch, 0)
            stats.append(batch_stats)
            losses.append(loss.item())
        self.objective.train()
        return {"loss": sum(losses) / len(losses), **summarise(stats)}

    def checkpoint_dir(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step_{step:07d}"

    def save_checkpoint(self) -> None:
        """Save head, optimiser and schedule; progress.json, written last, marks the checkpoint whole. Only the newest
        KEEP_CHECKPOINTS whole ones stay: a head's optimiser state is hundreds of MB, and a run of hours saves often."""
        folder = self.checkpoint_dir(self.step)
        self.accelerator.save_state(str(folder))
        if self.accelerator.is_main_process:
            (folder / "progress.json").write_text(json.dumps({"step": self.step, "history": self.history}))
            for old in self.whole_checkpoints()[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old)

    def whole_checkpoints(self) -> list[Path]:
        """The checkpoints a save finished (those with progress.json), oldest first."""
        return sorted(p for p in (self.out / "checkpoints").glob("step_*") if (p / "progress.json").exists())

    def resume(self) -> bool:
        """Continue from the latest complete checkpoint under out/checkpoints, if any."""
        done = self.whole_checkpoints()
        if not done:
            return False
        self.accelerator.load_state(str(done[-1]))
        progress = json.loads((done[-1] / "progress.json").read_text())
        self.step, self.history = progress["step"], progress["history"]
        return True

    def fit(self, max_steps: int | None = None, time_limit_s: float | None = None) -> dict:
        """Train to the end of the schedule (or `max_steps` total, or a time budget); resumable; returns a summary."""
        resumed = self.resume()
        start_step, started = self.step, time.time()
        stop = self.total_steps if max_steps is None else min(self.total_steps, max_steps)
        bar = progress_bar(total=stop, initial=self.step, desc=f"fit {self.unwrapped.kind}", unit="step",
                           disable=not self.accelerator.is_main_process)
        running, timed = None, None
        while self.step < stop:
            if self.step - start_step == 1:
                timed = time.time()  # the rate leaves out the first step, which pays for start-up (a GPU's most)
            if time_limit_s is not None and self.step - start_step == 1 + self._timed_steps():
                stop = self._fit_schedule_to_time(timed, started, time_limit_s, stop, self.step - start_step - 1)
                bar.total = stop
            loss = self.train_step()
            running = loss if running is None else 0.95 * running + 0.05 * loss
            bar.set_postfix(loss=f"{running:.3f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}", refresh=False)
            bar.update(1)  # redraws at most every mininterval
            if self.config.eval_every and self.step % self.config.eval_every == 0 and self.step < stop:
                self._log_eval(bar)
            if self.config.save_every and self.step % self.config.save_every == 0:
                self.save_checkpoint()
            if time_limit_s is not None and time.time() - started > time_limit_s:
                break
        bar.close()
        final = self._log_eval(None)
        if self.step % max(1, self.config.save_every) and self.config.save_every:
            self.save_checkpoint()
        return {"resumed": resumed, "steps": self.step, "total_steps": self.total_steps,
                "steps_this_run": self.step - start_step, "seconds": time.time() - started,
                "train_loss": running, "validation": final, "config": asdict(self.config)}

    def _timed_steps(self) -> int:
        """Steps timed before the schedule is fitted to a time budget: the warm-up (10-200 steps), whose learning rate
        does not depend on the schedule's length, so the fit moves no step's rate, and long enough to average over
        batches of unequal cost."""
        return min(200, max(10, self.config.warmup))

    def _fit_schedule_to_time(self, timed: float, started: float, time_limit_s: float, stop: int, steps: int) -> int:
        """Shorten the cosine schedule to the steps the time budget allows, at the rate of the `steps` since `timed`."""
        rate = steps / max(1e-9, time.time() - timed)
        affordable = self.step + int(rate * (time_limit_s - (time.time() - started)))
        if affordable < stop:
            self.total_steps = stop = max(self.step + 1, affordable)
            print(f"time budget: the schedule now ends at step {stop} ({rate * 60:.1f} steps/min)")
        return stop

    def _log_eval(self, bar) -> dict | None:
        metrics = self.evaluate()
        if metrics is not None:
            self.history.append({"step": self.step, **metrics})
            line = (f"step {self.step}: val loss {metrics['loss']:.3f}, acceptance per step "
                    + " ".join(f"{a:.2f}" for a in metrics["acceptance"]) + f", chain tau {metrics['chain_tau']:.2f}")
            (bar.write if bar is not None else print)(line) if self.accelerator.is_main_process else None
        return metrics

    def save_head(self, folder: str | Path, dtype: torch.dtype = torch.float16) -> Path | None:
        """Write the head in the official layout (main process only)."""
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return None
        head = self.unwrapped
        return save_head(head, folder, dtype)
