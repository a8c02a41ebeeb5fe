"""Offline paradigms on FSDP2: SFT on AgentGym trajectories and DPO on pairs of trajectories.

Both start from ``model.path`` and end with a Hugging Face checkpoint in
``<output_dir>/final`` (config + safetensors + tokenizer files) that ``horizonrl train ...
model.path=<output_dir>/final`` starts RL from and that vLLM / transformers load.

Processes: ``run_offline`` tokenises the data once (offline_data.py), then train in
this process (one rank) or start ``num_ranks`` rank processes on loopback with torchrun-style
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as the RL launcher starts
the learner; under torchrun itself (WORLD_SIZE set) this process is one of the ranks. Each
rank runs one loop with timed phases:

    plan        the global batches of all epochs, from the seed (every rank computes the same)
    reference   DPO only: log π_ref of every pair with the starting weights, before any update
                (the frozen reference is the starting model, so no second model is kept)
    measure     SFT: NLL of all the data; DPO: loss and reward accuracy of all pairs (before and after)
    step        this rank's contiguous share of the batch → micro-batches → loss, backward;
                grad clip, AdamW, LR schedule
    save        gather the full state dict on rank 0 and write the Hugging Face checkpoint

Losses (pure functions below, tested against hand computations):

    SFT   L = − Σ_t m_t log π(x_t | x_<t) / N           N = loss tokens of the whole step (all ranks)
    DPO   L = (1/P) Σ_pairs − log σ(β [(log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))])
          log π(y) = Σ_t m_t log π(x_t | x_<t), the sequence's log-probability over its gpt tokens
          (Rafailov et al. 2023, arXiv 2305.18290, eq. 7); P = pairs of the step
          + sft_weight · (− Σ_chosen log π(y_c) / N_c)   optional NLL on the chosen sides (RPO,
          Pang et al. 2024, arXiv 2404.19733), N_c = their loss tokens in the step; 0 by default

Every rank passes the step-wide N (or P), so Σ_ranks Σ_micro-batches is the step's loss exactly,
whatever the split; FSDP averages gradients over W ranks and the ×W undoes it (as the RL loss).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from horizonrl.learner.batching import PAD_TOKEN_ID  # right padding: causal attention never looks right
from horizonrl.core.adapter_format import CHECKPOINT_ADAPTER_DIR
from horizonrl.learner.lora import LoraSettings, merged_state_dict, save_adapter
from horizonrl.learner.services import RankInfo
from horizonrl.learner.packing import pack_rows, packed_batch
from horizonrl.learner.policy_loss import token_logprobs
from horizonrl.learner.model import (build_sharded_model, flash_attn_installed, gather_full_state_dict,
                                     loss_token_logits, resolve_backend, save_hf_checkpoint)
from horizonrl.learner.offline_data import DPOData, OfflineDataError, SFTData, load_dpo_data, load_sft_data
from horizonrl.learner.algorithm import lr_multiplier
from horizonrl.core.config import ConfigError
from horizonrl.core.offline_config import OfflineConfig, dump_offline_config, load_offline_config
from horizonrl.core.precision import PrecisionPolicy, resolve_precision
from horizonrl.core.programs import OFFLINE_RANK_MODULE, offline_rank_command
from horizonrl.core.runtime import LAUNCHER_PID_ENV, PhaseTimer, setup_logging, stop_when_launcher_dies

log = logging.getLogger("horizonrl.offline")

PROCESS_GROUP_TIMEOUT_S = 1800.0
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"


# ---------------------------------------------------------------------------- the losses (pure)


def sft_loss(logprobs: torch.Tensor, num_loss_tokens: int) -> torch.Tensor:
    """− Σ log π / N over this micro-batch's loss tokens; N counts the whole step's loss tokens."""
    return -logprobs.sum() / max(num_loss_tokens, 1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and implicit rewards; every argument is (P,) sequence log-probabilities.

    r_c = β (log π(y_c) − log π_ref(y_c)),  r_r = β (log π(y_r) − log π_ref(y_r)),
    loss = − log σ(r_c − r_r)        (= log 2 when π = π_ref).   Returns (loss, r_c, r_r), each (P,).
    """
    chosen_rewards = beta * (policy_chosen - reference_chosen)
    rejected_rewards = beta * (policy_rejected - reference_rejected)
    return -F.logsigmoid(chosen_rewards - rejected_rewards), chosen_rewards, rejected_rewards


def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and mask -> (per-token log π of the N loss tokens (N,), per-row sums (B,)).

    Logits at t−1 predict token t, so only the (N, V) rows where ``loss_mask[:, 1:]`` is 1 are
    computed (``loss_token_logits``: memory about N·V, not B·T·V). ``position_ids``: packed rows
    (learner/packing.py), whose per-row sums are not per-sequence.
    """
    selected = loss_mask[:, 1:].bool()
    logprobs = token_logprobs(loss_token_logits(model, input_ids, selected, position_ids),
                              input_ids[:, 1:][selected])  # (N,)
    rows = selected.nonzero()[:, 0]
    sums = torch.zeros(input_ids.shape[0], dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)
    return logprobs, sums


# ---------------------------------------------------------------------------- batches


def collate(sequences: list[tuple[np.ndarray, np.ndarray]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and loss mask; an empty list gives one padding token (no loss tokens),
    so a rank with a smaller share still takes part in every FSDP collective."""
    if not sequences:
        return torch.full((1, 1), PAD_TOKEN_ID, dtype=torch.long, device=device), torch.zeros(1, 1, device=device)
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), PAD_TOKEN_ID, dtype=torch.long)
    loss_mask = torch.zeros(len(sequences), length)
    for row, (ids, mask) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
        loss_mask[row, : len(ids)] = torch.from_numpy(mask.astype(np.float32))
    loss_mask[:, 0] = 0  # the first token has no prediction
    return input_ids.to(device), loss_mask.to(device)


def epoch_batches(num_items: int, batch_size: int, epochs: int, seed: int, max_steps: int | None) -> list[np.ndarray]:
    """The global batches (item indices) of every epoch: a seeded permutation per epoch, cut in order;
    an epoch's last batch may be smaller. Every rank computes the same list."""
    batches = []
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(num_items)
        batches += [order[i : i + batch_size] for i in range(0, num_items, batch_size)]
    return batches[:max_steps] if max_steps else batches


def rank_chunks(indices: np.ndarray, rank: int, world_size: int, micro_batch_size: int) -> list[np.ndarray]:
    """This rank's contiguous share of a global batch in micro-batches, padded with empty ones to the
    count every rank runs (FSDP's forward and backward are collectives)."""
    share_size = math.ceil(len(indices) / world_size)
    share = indices[rank * share_size : (rank + 1) * share_size]
    count = max(1, math.ceil(share_size / micro_batch_size))
    chunks = [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
    return chunks + [share[:0]] * (count - len(chunks))


# ---------------------------------------------------------------------------- one optimizer step


@dataclass
class Trainer:
    """What one rank trains with; the paradigm-specific work is in the step and measure functions."""

    config: OfflineConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device
    rank: int
    world_size: int

    def chunks(self, indices: np.ndarray) -> list[np.ndarray]:
        return rank_chunks(indices, self.rank, self.world_size, self.config.micro_batch_size)

    def update(self, metrics: torch.Tensor) -> float:
        """Clip, step, schedule; returns the grad norm. ``metrics`` is reduced over ranks in place."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        dist.all_reduce(metrics, op=dist.ReduceOp.SUM)
        return float(norm)


def sft_step(tr: Trainer, data: SFTData, indices: np.ndarray) -> dict[str, float]:
    seqs = data.sequences
    num_loss_tokens = sum(seqs.num_loss_tokens(int(i)) for i in indices)  # N of the whole step: no collective
    tr.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(3, dtype=torch.float64)  # Σ −log π, loss tokens, tokens
    for chunk in tr.chunks(indices):
        logprobs, _ = sequence_logprobs(tr.model, *sft_micro_batch(tr.config, [seqs.get(int(i)) for i in chunk],
                                                                  tr.device))
        (sft_loss(logprobs, num_loss_tokens) * tr.world_size).backward()
        tokens = sum(seqs.num_tokens(int(i)) for i in chunk)
        sums += torch.tensor([-float(logprobs.detach().sum()), logprobs.numel(), tokens], dtype=torch.float64)
    grad_norm = tr.update(sums)
    return {"loss": float(sums[0] / max(sums[1], 1)), "grad_norm": grad_norm, "loss_tokens": float(sums[1]),
            "tokens": float(sums[2])}


def sft_micro_batch(config: OfflineConfig, sequences: list[tuple[np.ndarray, np.ndarray]],
                    device: torch.device) -> tuple[torch.Tensor, ...]:
    """A micro-batch's (input_ids, loss_mask[, position_ids]): padded rows, or with ``pack_tokens`` packed ones."""
    if config.pack_tokens is None or not sequences:
        return collate(sequences, device)
    rows = pack_rows([len(ids) for ids, _ in sequences], config.pack_tokens)
    return packed_batch(sequences, rows, device)


def _pair_logprobs(model: nn.Module, data: DPOData, chunk: np.ndarray,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(y_c), log π(y_r)), each (P,), of the pairs in ``chunk`` in one forward over 2P sequences."""
    sequences = [data.chosen.get(int(i)) for i in chunk] + [data.rejected.get(int(i)) for i in chunk]
    input_ids, loss_mask = collate(sequences, device)
    _, sums = sequence_logprobs(model, input_ids, loss_mask)  # an empty chunk: one padding row, sliced away
    return sums[: len(chunk)], sums[len(chunk) : 2 * len(chunk)]


def dpo_step(tr: Trainer, data: DPOData, indices: np.ndarray, reference: torch.Tensor) -> dict[str, float]:
    """DPO over the step's P pairs, plus ``sft_weight`` × the token-mean NLL of the chosen sides (RPO)."""
    beta, alpha, num_pairs = tr.config.beta, tr.config.sft_weight, len(indices)
    chosen_tokens = sum(data.chosen.num_loss_tokens(int(i)) for i in indices)  # N_c of the whole step
    tr.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(8, dtype=torch.float64)  # see _pair_sums
    for chunk in tr.chunks(indices):
        chosen, rejected = _pair_logprobs(tr.model, data, chunk, tr.device)
        ref = reference[torch.as_tensor(chunk, dtype=torch.long)].to(chosen)  # (P, 2)
        losses, r_c, r_r = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta)
        loss = losses.sum() / num_pairs
        if alpha > 0:
            loss = loss + alpha * sft_loss(chosen, chosen_tokens)
        (loss * tr.world_size).backward()
        sums += _pair_sums(losses, r_c, r_r, chosen, [data.chosen.num_loss_tokens(int(i)) for i in chunk])
    grad_norm = tr.update(sums)
    return {**_pair_metrics(sums), "grad_norm": grad_norm}


def _pair_sums(losses: torch.Tensor, r_c: torch.Tensor, r_r: torch.Tensor, policy_chosen: torch.Tensor,
               chosen_tokens: list[int]) -> torch.Tensor:
    """Σ loss, pairs, pairs with r_c > r_r, Σ margin, Σ r_c, Σ r_r, Σ −log π(y_c), chosen loss tokens."""
    losses, r_c, r_r = losses.detach().double().cpu(), r_c.detach().double().cpu(), r_r.detach().double().cpu()
    return torch.tensor([float(losses.sum()), losses.numel(), float((r_c > r_r).sum()), float((r_c - r_r).sum()),
                         float(r_c.sum()), float(r_r.sum()), -float(policy_chosen.detach().sum()), sum(chosen_tokens)],
                        dtype=torch.float64)


def _pair_metrics(sums: torch.Tensor) -> dict[str, float]:
    n = max(float(sums[1]), 1.0)
    return {"loss": float(sums[0]) / n, "reward_accuracy": float(sums[2]) / n, "reward_margin": float(sums[3]) / n,
            "reward_chosen": float(sums[4]) / n, "reward_rejected": float(sums[5]) / n,
            "chosen_nll": float(sums[6]) / max(float(sums[7]), 1.0), "pairs": float(sums[1])}


# ---------------------------------------------------------------------------- whole-data passes (no grad)


def _all_batches(num_items: int, world_size: int, micro_batch_size: int) -> list[np.ndarray]:
    per_step = micro_batch_size * world_size
    return [np.arange(i, min(i + per_step, num_items)) for i in range(0, num_items, per_step)]


@torch.no_grad()
def measure_sft(tr: Trainer, data: SFTData) -> dict[str, float]:
    """Token-mean NLL of the loss tokens of all the data (a collective)."""
    sums = torch.zeros(2, dtype=torch.float64)
    for indices in _all_batches(len(data), tr.world_size, tr.config.micro_batch_size):
        for chunk in tr.chunks(indices):
            logprobs, _ = sequence_logprobs(tr.model, *collate([data.sequences.get(int(i)) for i in chunk], tr.device))
            sums += torch.tensor([-float(logprobs.sum()), logprobs.numel()], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return {"nll": float(sums[0] / max(sums[1], 1)), "loss_tokens": float(sums[1])}


@torch.no_grad()
def pair_logprobs_all(tr: Trainer, data: DPOData) -> torch.Tensor:
    """(P, 2) float64: (log π(y_c), log π(y_r)) of every pair with the current weights (a collective)."""
    out = torch.zeros(len(data), 2, dtype=torch.float64)
    for indices in _all_batches(len(data), tr.world_size, tr.config.micro_batch_size):
        for chunk in tr.chunks(indices):
            chosen, rejected = _pair_logprobs(tr.model, data, chunk, tr.device)
            out[torch.as_tensor(chunk, dtype=torch.long)] = torch.stack([chosen, rejected], dim=1).double().cpu()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)  # each pair was filled by exactly one rank
    return out


def measure_dpo(tr: Trainer, data: DPOData, reference: torch.Tensor) -> dict[str, float]:
    policy = pair_logprobs_all(tr, data)
    losses, r_c, r_r = dpo_loss(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], tr.config.beta)
    chosen_tokens = [data.chosen.num_loss_tokens(i) for i in range(len(data))]
    return _pair_metrics(_pair_sums(losses, r_c, r_r, policy[:, 0], chosen_tokens))


# ---------------------------------------------------------------------------- the loop


def offline_precision(config: OfflineConfig, device: torch.device) -> PrecisionPolicy:
    """The learner's precision policy (core/precision.py) for an offline run: fp32 master weights and AdamW
    state, bf16 compute on CUDA. No engine is involved; the checkpoint is saved from the master weights."""
    on_cuda = device.type == "cuda"
    try:
        return resolve_precision(config.param_dtype, config.compute_dtype, "auto", None, learner_on_cuda=on_cuda,
                                 engine_on_gpu=on_cuda, flash_attn_installed=flash_attn_installed())
    except ValueError as error:
        raise ConfigError(str(error)) from error


def build_trainer(config: OfflineConfig, device: torch.device, rank: int, world_size: int, total_steps: int) -> Trainer:
    # As the RL learner loads: meta-device init, rank 0 alone reads the files, shards are scattered.
    lora = LoraSettings.of(config.lora)
    model = build_sharded_model(config.model.path, kind="policy", policy=offline_precision(config, device),
                                device=device, lora=lora, seed=config.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, config.lr_warmup_steps, total_steps, config.lr_schedule, config.min_lr_ratio))
    return Trainer(config, model, optimizer, scheduler, device, rank, world_size)


def fit(config: OfflineConfig, paradigm: str, data: SFTData | DPOData,
        device: torch.device) -> tuple[dict[str, Any], nn.Module]:
    """Train on an initialised process group; returns (summary, the sharded model). Rank 0 writes
    the checkpoint, metrics.jsonl and summary.json. A collective: every rank calls it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    torch.manual_seed(config.seed)
    plan = epoch_batches(len(data), config.batch_size, config.epochs, config.seed, config.max_steps)
    timer = PhaseTimer()
    with timer("load_s"):
        tr = build_trainer(config, device, rank, world_size, len(plan))
    times = timer.seconds
    log.info("%s: model %s sharded over %d rank(s) in %.1f s; %d %s, %d steps (%d epoch(s) of %d, batch %d, "
             "micro-batch %d)", paradigm, config.model.path, world_size, times["load_s"], len(data),
             "records" if paradigm == "sft" else "pairs", len(plan), config.epochs,
             math.ceil(len(data) / config.batch_size), config.batch_size, config.micro_batch_size)
    summary: dict[str, Any] = {"paradigm": paradigm, "steps": len(plan), "world_size": world_size,
                               "items": len(data), "model": config.model.path}
    reference = None
    if paradigm == "dpo":
        with timer("reference_s"):
            tr.model.eval()
            reference = pair_logprobs_all(tr, data)
    if config.measure_before_after:
        summary["before"] = _measure(tr, paradigm, data, reference)
        log.info("before training: %s", _fmt(summary["before"]))

    with timer("train_s"):
        first, last = train_loop(tr, paradigm, data, plan, reference)
    summary.update(first_step=first, last_step=last)

    if config.measure_before_after:
        tr.model.eval()
        summary["after"] = _measure(tr, paradigm, data, reference)
        log.info("after training: %s", _fmt(summary["after"]))
    with timer("save_s"):
        summary["checkpoint"] = str(save_checkpoint(tr.model, config))
    summary["times"] = times
    if is_main:
        (config.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        log.info("%s done: %d steps in %.1f s; checkpoint %s (start RL from it: horizonrl train CONFIG model.path=%s)",
                 paradigm, len(plan), times["train_s"], summary["checkpoint"], summary["checkpoint"])
    return summary, tr.model


def train_loop(tr: Trainer, paradigm: str, data: SFTData | DPOData, plan: list[np.ndarray],
               reference: torch.Tensor | None) -> tuple[dict[str, float], dict[str, float]]:
    """Every optimizer step of ``plan``; rank 0 logs them and appends them to metrics.jsonl.
    Returns the first and the last step's metrics."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    config, is_main = tr.config, tr.rank == 0
    steps_per_epoch = math.ceil(len(data) / config.batch_size)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tr.model.train()
    with open(config.out / METRICS_FILE, "w") if is_main else _nothing() as metrics_file, logging_redirect_tqdm():
        for step, indices in enumerate(tqdm(plan, desc=paradigm, disable=not is_main, file=sys.stderr), start=1):
            t0 = time.perf_counter()
            lr = tr.scheduler.get_last_lr()[0]
            if paradigm == "sft":
                metrics = sft_step(tr, data, indices)
            else:
                metrics = dpo_step(tr, data, indices, reference)
            metrics.update(step=step, epoch=(step - 1) // steps_per_epoch + 1, lr=lr, step_s=time.perf_counter() - t0)
            first, last = first or metrics, metrics
            if is_main:
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                if step % config.log_every == 0 or step == len(plan):
                    log.info("step %d/%d epoch %d: %s", step, len(plan), metrics["epoch"], _fmt(metrics))
    return first, last


@contextmanager
def _nothing():
    yield None


def _measure(tr: Trainer, paradigm: str, data, reference) -> dict[str, float]:
    return measure_sft(tr, data) if paradigm == "sft" else measure_dpo(tr, data, reference)


def save_checkpoint(model: nn.Module, config: OfflineConfig) -> Path:
    """Collective: gather the full weights; rank 0 writes the Hugging Face checkpoint (the RL learner's writer)."""
    state_dict = gather_full_state_dict(model)
    out = config.checkpoint_dir
    if dist.get_rank() == 0:
        model_config = copy.deepcopy(model.config)
        model_config.use_cache = True  # turned off for training; generation wants it
        if config.lora is None:
            save_hf_checkpoint(model_config, state_dict, config.model.path, out)
        else:  # the merged model, and the adapter beside it (as the RL learner's checkpoints)
            lora = LoraSettings.of(config.lora)
            save_hf_checkpoint(model_config, merged_state_dict(state_dict, lora), config.model.path, out,
                               extra=lambda tmp: save_adapter(tmp / CHECKPOINT_ADAPTER_DIR, state_dict, lora,
                                                              base_model=config.model.path))
    dist.barrier()
    return out


def _fmt(metrics: dict[str, float]) -> str:
    skip = {"step", "epoch"}
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items() if k not in skip)


# ---------------------------------------------------------------------------- processes


def load_data(config: OfflineConfig, paradigm: str) -> SFTData | DPOData:
    from transformers import AutoTokenizer

    from horizonrl.core.chat import ChatTemplateError, ChatTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(config.model.path))
    if not chat.append_only:  # RL episodes branch at a rewrite (docs/algorithms.md); offline data does not (yet)
        raise ChatTemplateError("the model's chat template rewrites earlier turns (it is not append-only); offline "
                                "training lays conversations out append-only and cannot use it")
    load = load_sft_data if paradigm == "sft" else load_dpo_data
    data = load(config.data, chat, config.max_length, config.system_prompt)
    if len(data) == 0:
        raise OfflineDataError(f"no {paradigm} data left to train on: "
                               f"{data.stats.summary(paradigm, config.max_length)}")
    return data


def train_rank(config: OfflineConfig, paradigm: str, data: SFTData | DPOData, ranks: RankInfo) -> dict[str, Any]:
    """One rank from start to end: process group, threads, :func:`fit`, teardown."""
    backend = resolve_backend(config.backend)
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
        device = torch.device("cuda", ranks.local_rank)
    else:
        device = torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // ranks.world_size))
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
        init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}",
        rank=ranks.rank, world_size=ranks.world_size, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    try:
        summary, _ = fit(config, paradigm, data, device)
        return summary
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def run_offline(config: OfflineConfig, paradigm: str) -> dict[str, Any]:
    """Tokenise, train on ``config.num_ranks`` ranks, write the checkpoint; returns rank 0's summary.

    Raises on failure (a failed rank stops the others)."""
    if paradigm not in ("sft", "dpo"):
        raise ValueError(f"paradigm must be 'sft' or 'dpo', got {paradigm!r}")
    config.out.mkdir(parents=True, exist_ok=True)
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        return train_rank(config, paradigm, load_data(config, paradigm), RankInfo.from_environ())
    (config.out / "config.yaml").write_text(dump_offline_config(config))
    data = load_data(config, paradigm)
    (config.out / "data_stats.json").write_text(json.dumps(data.stats.to_dict(), indent=1) + "\n")
    from horizonrl.protocol.transport import free_port

    if config.num_ranks == 1:
        return train_rank(config, paradigm, data, RankInfo(0, 1, 0, "127.0.0.1", free_port()))
    data_file = config.out / f"tokenized_{paradigm}.npz"
    data.save(data_file)
    _spawn_ranks(config, paradigm, data_file)
    return json.loads((config.out / SUMMARY_FILE).read_text())


def _spawn_ranks(config: OfflineConfig, paradigm: str, data_file: Path) -> None:
    from horizonrl.protocol.transport import free_port

    port, world = free_port(), config.num_ranks
    procs = []
    try:
        for rank in range(world):
            # LAUNCHER_PID_ENV: each rank ends with this process, however it dies (a SIGKILL runs no finally below)
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
                   LAUNCHER_PID_ENV: str(os.getpid())}
            args = offline_rank_command(paradigm, str(config.out / "config.yaml"), str(data_file))
            procs.append(subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        log.info("started %d %s ranks (pids %s)", world, paradigm, ", ".join(str(p.pid) for p in procs))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, rc) for rank, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                raise RuntimeError(f"{paradigm} rank {failed[0][0]} exited with code {failed[0][1]}; stopped the "
                                   "others")
            if all(rc == 0 for rc in codes):
                return
            time.sleep(0.2)
    finally:
        for proc in procs:  # only ours, by pid (each leads its own process group)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def rank_main(argv: list[str] | None = None) -> int:
    """One rank started by :func:`run_offline` (RANK, WORLD_SIZE, MASTER_PORT in the environment)."""
    parser = argparse.ArgumentParser(prog=f"python -m {OFFLINE_RANK_MODULE}")
    parser.add_argument("paradigm", choices=["sft", "dpo"])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="the tokenised data the launching process wrote")
    args = parser.parse_args(argv)
    config = load_offline_config(args.config)
    ranks = RankInfo.from_environ()
    setup_rank_logging(config.log_level, ranks.rank)
    stop_when_launcher_dies()  # the `horizonrl sft|dpo` process that started the ranks died: no orphans
    data = (SFTData if args.paradigm == "sft" else DPOData).load(args.data)
    try:
        train_rank(config, args.paradigm, data, ranks)
        return 0
    except Exception:
        log.exception("%s rank %d failed", args.paradigm, ranks.rank)
        return 1


def setup_rank_logging(level: str, rank: int) -> None:
    """The run's one log format (core/runtime.py); ranks other than 0 say only what goes wrong."""
    setup_logging(f"offline-{rank}", level if rank == 0 else "WARNING")


if __name__ == "__main__":
    from horizonrl.core.runtime import exit_skipping_finalization

    exit_skipping_finalization(rank_main())  # its gloo group can abort interpreter finalization
