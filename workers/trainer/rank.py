"""One FSDP2 trainer rank: the model sharded with ``fully_shard`` (gloo on CPU, NCCL on GPU),
float32 or bf16 mixed precision over float32 weights, optionally with activation checkpointing,
AdamW with a warm-up and constant or cosine schedule, the GRPO loss on packed micro-batches,
gradient accumulation and clipping, checkpoints (``torch.distributed.checkpoint``: model,
optimizer, scheduler, step) and the full state dict for publishing and the final policy.

``TrainerRank`` is a plain class; ``trainer_actor()`` makes it the Ray actor. Every method that
runs a collective must be called on all ranks together (``TrainerGroup`` does that). Each rank
gets the same number of micro-batches per mini-batch (``plan_micro_batches``); an empty one runs
a one-token forward and backward with zero loss so the collectives still match.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcall.orchestrator.algorithms import LossConfig
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import LoRAConfig
from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.domain import WorkerRole, WorkerStatus
from rollcall.workers import collective
from rollcall.workers import lora as adapters
from rollcall.workers.lora import inject, is_adapter, read_adapter
from rollcall.workers.trainer.batch import TrainSequence
from rollcall.workers.trainer.forward import token_logprobs
from rollcall.workers.trainer.grpo import LossStats, agreement_stats, needs_proximal, policy_loss
from rollcall.workers.trainer.packing import pack
from rollcall.workers.weights import (
    WEIGHTS_FILE,
    publish,
    publish_adapter,
    read_metadata,
    version_dir,
)


@dataclass(frozen=True)
class RankSettings:
    model_dir: str
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_updates: int
    total_updates: int
    schedule: str  # "constant" | "cosine"
    min_lr_ratio: float
    grad_clip: float
    loss: LossConfig
    device: str = "cpu"
    seed: int = 0
    threads: int = 1
    log_entropy: bool = True
    logprob_chunk_tokens: int = 1024
    precision: str = "float32"  # "float32" | "bf16"
    activation_checkpointing: bool = False
    lora: LoRAConfig | None = None  # train adapters only, publish adapters only
    database_url: str | None = None  # with job_id: the rank registers and heartbeats
    job_id: int | None = None
    heartbeat_interval_s: float = 2.0
    # the rank's transactions left idle this long are ended by the server (a rank stopped
    # mid-transaction must not keep its worker row from the dead-worker sweep); the driver
    # sets control_plane.heartbeat_timeout_s
    db_idle_tx_timeout_s: float = 60.0


def _loopback_interface() -> str:
    """The name of this machine's loopback interface: ``lo`` on Linux (``lo0`` elsewhere)."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def lr_factor(update: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` updates, then constant or cosine decay to ``min_ratio``."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (update - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainerRank:
    def __init__(self, rank: int, world: int, settings: RankSettings) -> None:
        self.rank, self.world, self.settings = rank, world, settings
        self.model: Any = None
        self.ref: Any = None
        self.updates = 0
        self.worker_id: int | None = None
        self._stop = threading.Event()
        # collective transport (rank 0): the last published version's tensors, the thread
        # writing its file, and the rendezvous the broadcasts' groups form at
        self._staged: tuple[int, dict[str, Any]] | None = None
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._rendezvous: Any = None
        self._adapter_config: dict[str, Any] | None = None

    # -- set-up -------------------------------------------------------------------------------

    def pid(self) -> int:
        """Answered as soon as the actor runs: Ray placed it (``wait_placed``)."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group (called on rank 0 only)."""
        host = socket.gethostbyname(socket.gethostname()) if self.world > 1 else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, int(s.getsockname()[1])

    def setup(self, master: tuple[str, int]) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        s = self.settings
        torch.set_num_threads(s.threads)
        cuda = s.device.startswith("cuda")
        if not dist.is_initialized() and self.world == 1:
            # one rank: no rendezvous to serve (a TCPStore listens on every interface, with
            # no authentication), and gloo's own socket on loopback (docs/security.md)
            if not cuda:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
            dist.init_process_group(
                "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
        elif not dist.is_initialized():
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                init_method=f"tcp://{master[0]}:{master[1]}",
                rank=self.rank,
                world_size=self.world,
            )
        self.device = torch.device(s.device)
        torch.manual_seed(s.seed)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))

        # The sharded parameters (and so the optimizer state) stay float32 either way; bf16 is
        # the dtype of the gathered copies the forward and backward compute with.
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if s.precision == "bf16" else None,
            reduce_dtype=torch.float32,
        )

        def sharded(path: str, *, train: bool) -> Any:
            # Loaded on the host and left there: ``fully_shard`` moves each module's states to
            # the mesh's device as it shards them (one layer's full weights at a time, then
            # only this rank's shard stays), instead of the whole model on every rank's
            # device first.
            m: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if train and s.lora is not None:  # adapters in place; the base frozen
                inject(m, s.lora)
            if train and s.activation_checkpointing:
                m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(m, mesh=mesh, mp_policy=mp)
            return m

        self.model = sharded(s.model_dir, train=True)
        self.model.train()
        self.tie = bool(getattr(self.model.config, "tie_word_embeddings", False))
        if s.loss.kl.coef > 0:
            self.ref = sharded(s.model_dir, train=False)
            self.ref.eval()
        # with LoRA, optimizer state for the adapters only
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda u: lr_factor(
                u,
                warmup=s.warmup_updates,
                total=s.total_updates,
                schedule=s.schedule,
                min_ratio=s.min_lr_ratio,
            ),
        )
        params = sum(p.numel() for p in self.model.parameters())
        self._register()
        return {
            "rank": self.rank,
            "parameters_local": params,
            "trainable_local": sum(p.numel() for p in trainable),
            "pid": os.getpid(),
            "worker_id": self.worker_id,
        }

    def _register(self) -> None:
        """A worker row for this rank, kept alive by a heartbeat thread (operators and drills
        see trainer ranks like rollout nodes)."""
        s = self.settings
        if s.database_url is None or s.job_id is None:
            return
        import ray

        db = open_database(s.database_url, pool_size=1, idle_tx_timeout_s=s.db_idle_tx_timeout_s)
        self.buffer = RolloutBuffer(db, s.job_id)
        self.worker_id = self.buffer.register_worker(
            f"trainer-{self.rank}",
            role=WorkerRole.TRAINER,
            host=socket.gethostname(),
            pid=os.getpid(),
            # the Ray node it runs on (worker list, placement checks), as for rollout nodes
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
        ).id

        def beat() -> None:
            while not self._stop.wait(s.heartbeat_interval_s):
                # a missed beat only costs visibility: a trainer rank holds no leases
                with contextlib.suppress(Exception):
                    self.buffer.beat(self.worker_id or 0)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    # -- training -----------------------------------------------------------------------------

    def train(self, mini_batches: list[list[list[TrainSequence]]]) -> dict[str, Any]:
        """One optimizer update per mini-batch (this rank's micro-batches of each)."""
        import torch

        loss_cfg = self.settings.loss
        stats = LossStats()
        loss_sum = 0.0
        grad_norms = []
        proximal = needs_proximal(loss_cfg.correction) and len(mini_batches) > 1
        old = [[self._logprobs(mb)[0] for mb in mini] for mini in mini_batches] if proximal else []
        for m, mini in enumerate(mini_batches):
            for k, micro in enumerate(mini):
                self.model.set_requires_gradient_sync(k == len(mini) - 1)
                _, logp, entropy = self._forward(micro, grad=True)
                if not micro:  # keeps the collectives of an empty micro-batch in step
                    (logp.sum() * 0.0).backward()
                    continue
                beh = self._values(micro, lambda s: s.behaviour_logprobs)
                if proximal:
                    old_logp = old[m][k]
                elif needs_proximal(loss_cfg.correction):
                    # One update per step: the proximal policy is the current one, so its
                    # log-probs are this forward's (detached); no second forward needed.
                    old_logp = logp.detach()
                else:
                    old_logp = beh
                mask = self._values(micro, lambda s: s.loss_mask).float()
                # log-probs under the step's starting weights: the proximal ones, or this
                # forward's before the step's first update
                start = old[m][k] if proximal else logp.detach() if m == 0 else None
                if start is not None:
                    on = (mask > 0) & self._per_token(micro, lambda s: s.on_policy).bool()
                    stats = stats + agreement_stats(start, beh, on)
                adv = mask * self._per_token(micro, lambda s: s.advantage)
                weights = mask * self._per_token(micro, lambda s: s.scale)
                ref = None
                if self.ref is not None:
                    with torch.no_grad():
                        ref = self._logprobs(micro, model=self.ref)[0]
                out = policy_loss(
                    loss_cfg,
                    logp=logp,
                    old_logp=old_logp,
                    behaviour_logp=beh,
                    advantages=adv,
                    weights=weights,
                    ref_logp=ref,
                    entropy=entropy,
                    segments=self._segments(micro),
                )
                # Weights come from the mini-batch's totals over all ranks, so the rank losses
                # add up to it; FSDP averages gradients over ranks, hence the factor.
                (out.loss * self.world).backward()
                stats = stats + out.stats
                loss_sum += float(out.loss.detach())
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.updates += 1
        return {
            "stats": stats,
            "loss": loss_sum,
            "grad_norm": max(grad_norms) if grad_norms else 0.0,
            "lr": float(self.sched.get_last_lr()[0]),
        }

    def _forward(self, micro: list[TrainSequence], *, grad: bool, model: Any = None) -> Any:
        import torch

        model = model or self.model
        seqs = [s.token_ids.tolist() for s in micro] or [[0]]
        packed = pack(seqs, device=self.device)
        with torch.set_grad_enabled(grad):
            logp, entropy = token_logprobs(
                model,
                packed,
                temperature=self.settings.loss.temperature,
                chunk_tokens=self.settings.logprob_chunk_tokens,
                with_entropy=grad
                and (self.settings.log_entropy or self.settings.loss.entropy_coef > 0),
            )
        return packed, logp, entropy

    def _logprobs(self, micro: list[TrainSequence], model: Any = None) -> Any:
        _, logp, _ = self._forward(micro, grad=False, model=model)
        return logp.detach(), None

    def _values(self, micro: list[TrainSequence], get: Any) -> Any:
        import numpy as np
        import torch

        return torch.from_numpy(np.concatenate([np.asarray(get(s)) for s in micro])).to(self.device)

    def _segments(self, micro: list[TrainSequence]) -> Any:
        """Which sequence of the micro-batch each token belongs to.  # [N] int64"""
        import torch

        return torch.cat(
            [
                torch.full((len(s.token_ids),), i, dtype=torch.long, device=self.device)
                for i, s in enumerate(micro)
            ]
        )

    def _per_token(self, micro: list[TrainSequence], get: Any) -> Any:
        import torch

        return torch.cat(
            [torch.full((len(s.token_ids),), float(get(s)), device=self.device) for s in micro]
        )

    # -- state --------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Any] | None:
        """The unsharded weights on CPU (collective); rank 0 gets them, the others None."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        sd: dict[str, Any] = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank != 0:
            return None
        if self.tie:  # tied to the embedding; loaders re-tie it
            sd.pop("lm_head.weight", None)
        return {k: v.contiguous() for k, v in sd.items()}

    def adapter_state_dict(self) -> dict[str, Any] | None:
        """LoRA: the adapters' full tensors on CPU, by parameter name (collective: each one
        gathered from the ranks' shards in the same order on every rank); rank 0 gets them,
        the others None."""
        out = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().cpu()
        return out if self.rank == 0 else None

    def publish(self, root: str, version: int, keep: int, background: bool = False) -> str | None:
        """Write version ``version``'s weights for the rollout nodes (collective): the full
        weights, or with LoRA the adapter alone. With ``background`` (the collective
        transport) rank 0 keeps the tensors for ``broadcast`` and writes the files on a
        thread, off the step's critical path: the location returned holds the version once
        the write is done (readers see all of it or nothing)."""
        s = self.settings
        lora = s.lora
        state = self.full_state_dict() if lora is None else self.adapter_state_dict()
        if state is None:  # not rank 0
            return None
        dtype = self.publish_dtype()
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        # the optimizer updates behind these weights: a restart from them resumes the schedule
        meta = {"updates": str(self.updates), "dtype": str(dtype).removeprefix("torch.")}
        path = Path(root)

        def write() -> str:
            if lora is None:
                return publish(state, path, version, keep=keep, metadata=meta)
            return publish_adapter(
                state, self.adapter_config(), path, version, keep=keep, metadata=meta
            )

        if not background:
            return write()
        self.wait_for_files()
        self._staged = (version, state)

        def write_in_background() -> None:
            try:
                write()
            except BaseException as e:  # raised by the next publish (a trainer failure)
                self._writer_error = e

        self._writer = threading.Thread(
            target=write_in_background, name=f"publish-v{version}", daemon=True
        )
        self._writer.start()
        return str(version_dir(path, version))

    def wait_for_files(self) -> None:
        """The previous background publication's file is written (raise if it failed)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            raise RuntimeError(f"writing published weights failed: {error}") from error

    def weights_offer(self) -> dict[str, Any] | None:
        """Rank 0: what a broadcast of the last published version carries (its rendezvous,
        the tensors in order); None on other ranks or before a background publication."""
        if self.rank != 0 or self._staged is None:
            return None
        if self._rendezvous is None:
            self._rendezvous = collective.Rendezvous(collective.local_address())
        version, sd = self._staged
        return {
            "version": version,
            # a LoRA version is its adapter alone: the receivers need its config to load it
            "adapter": None if self.settings.lora is None else self.adapter_config(),
            "host": self._rendezvous.host,
            "port": self._rendezvous.port,
            "tensors": [
                [t.name, t.dtype, list(t.shape), t.nbytes] for t in collective.describe(sd)
            ],
        }

    def broadcast(self, offer: dict[str, Any]) -> float:
        """Rank 0: broadcast the staged version to the offer's group; the seconds it took.
        Raises ``BroadcastFailed`` when a member failed (the group is aborted; this process
        goes on)."""
        assert self._staged is not None and self._staged[0] == offer["version"]
        return collective.send(self._rendezvous, collective.Offer.from_json(offer), self._staged[1])

    def adapter_config(self) -> dict[str, Any]:
        """With LoRA, the adapter's ``adapter_config.json``: the same for every version."""
        assert self.settings.lora is not None
        if self._adapter_config is None:
            self._adapter_config = adapters.config_dict(self.settings.lora, self.settings.model_dir)
        return self._adapter_config

    def publish_dtype(self) -> Any:
        """The dtype weights are published in: the one the forward computes with (bf16 under
        ``precision: bf16``: the float32 weights cast, as FSDP2 casts them for the forward;
        half the bytes to write and load), float32 otherwise. Engines load them into their own
        dtype."""
        import torch

        return torch.bfloat16 if self.settings.precision == "bf16" else torch.float32

    def save_checkpoint(self, path: str, step: int) -> str:
        """Model, optimizer, scheduler and step, written to a temporary folder and renamed
        into place once complete (collective)."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        if self.rank == 0:
            torch.save(
                {"scheduler": self.sched.state_dict(), "step": step, "updates": self.updates},
                tmp / "trainer.pt",
            )
        dist.barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        dist.barrier()
        return str(final)

    def load_checkpoint(self, path: str) -> int:
        """Restore model, optimizer and scheduler (collective); returns the checkpoint's step."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        extra = torch.load(Path(path) / "trainer.pt", weights_only=False)
        self.sched.load_state_dict(extra["scheduler"])
        self.updates = int(extra["updates"])
        return int(extra["step"])

    def load_published(self, location: str, updates: int) -> int:
        """Set the model's weights to a published version's (collective: every rank reads the
        file and keeps its shard; published files live on storage all ranks see). The
        optimizer is left as it is: its AdamW moments (``exp_avg``, ``exp_avg_sq``) and their
        step counts stay those of the last checkpoint loaded before (or zero and none without
        one), older than the weights by the steps in between. The learning-rate schedule moves
        to the optimizer updates that produced the version: the count its file records, else
        ``updates`` (the caller's estimate). Returns the count used."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        recorded = read_metadata(location).get("updates")
        updates = int(recorded) if recorded is not None else updates
        if is_adapter(location):  # LoRA: the adapters only; the base never moved
            adapter = {k: v.float() for k, v in read_adapter(location).items()}
            set_model_state_dict(
                self.model, adapter, options=StateDictOptions(full_state_dict=True, strict=False)
            )
        else:
            # a bf16 publication (``precision: bf16``) goes back into the float32 weights:
            # the rounded values, not the float32 ones of a checkpoint
            sd: dict[str, Any] = {
                k: v.float() if v.is_floating_point() else v
                for k, v in load_file(str(Path(location) / WEIGHTS_FILE)).items()
            }
            if self.tie and "lm_head.weight" not in sd:  # published without the tied copy
                sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
            set_model_state_dict(self.model, sd, options=StateDictOptions(full_state_dict=True))
        self.updates = updates
        self.sched.last_epoch = updates
        for group, base, factor in zip(
            self.opt.param_groups, self.sched.base_lrs, self.sched.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(updates)
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]
        return updates

    def save_final(self, out: str) -> str | None:
        """The policy as a plain transformers model with its tokenizer (collective); with
        LoRA, merged, and the adapter in ``out/adapter``."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.wait_for_files()
        sd = self.full_state_dict()
        if sd is None:
            return None
        lora = self.settings.lora
        if lora is not None:  # the adapter beside the merged model
            (Path(out) / "adapter").mkdir(parents=True, exist_ok=True)
            adapters.write_adapter(
                {k: v for k, v in sd.items() if adapters.is_adapter_param(k)},
                Path(out) / "adapter",
                self.adapter_config(),
            )
            sd = adapters.merged_state_dict(sd, lora.alpha / lora.rank)
        config = AutoConfig.from_pretrained(self.settings.model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"final weights do not fit: {missing[:3]} {unexpected[:3]}")
        model.tie_weights()
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(self.settings.model_dir).save_pretrained(out)
        return out

    def shutdown(self) -> None:
        import torch.distributed as dist

        self._stop.set()
        with contextlib.suppress(Exception):  # the last version's file, if still being written
            self.wait_for_files()
        if self.worker_id is not None:
            self.buffer.requeue_worker(self.worker_id, WorkerStatus.STOPPED)
        if dist.is_initialized():
            dist.destroy_process_group()


def trainer_actor(
    num_cpus: float = 1.0, num_gpus: float = 0.0, resources: dict[str, float] | None = None
) -> Any:
    import ray

    return ray.remote(
        num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, max_restarts=0
    )(TrainerRank)
