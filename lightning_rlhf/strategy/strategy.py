"""``RLHFStrategy``: Lightning's FSDP2 strategy turned into HybridFlow's hybrid controller.

What it changes in Lightning's ``ModelParallelStrategy``:

- **setup**: loads nothing itself (``configure_model`` does), attaches a rollout engine to the actor, then
  shards every role's model with FSDP2 over all ranks (1-D data-parallel mesh) before the optimizers exist.
- **training_step**: rank 0 runs the module's ``training_step`` as the single controller; the other ranks
  serve its role calls (:class:`~lightning_rlhf.strategy.controller.Controller`). One call = one RL iteration,
  so ``global_step`` counts iterations however many optimizer steps the roles took.
- **validation_step**: routed the same way (Lightning's validation loop, its interval and sanity check work
  unchanged); with ``ValidationConfig.before_train`` one validation also runs before the first step.
- **data**: every rank iterates the same loader (no distributed sampler); only the controller's copy of a
  batch is used, and the transfer protocols split it.
- **faults**: a dead rank is named on the others (``liveness.py``); SIGTERM/SIGUSR1 on any rank stop every rank
  after the same step, save a checkpoint and exit with ``128 + signum`` (``preemption.py``); checkpoints are
  renamed into place only once complete, and a missing or incomplete ``ckpt_path`` is refused before anything
  loads (``checkpoint_io.py``, ``launcher.py``).
"""

from __future__ import annotations

import os
import signal
import uuid
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import VLLMConfig, config_from_dict
from lightning_rlhf.engines.rollout import HFRolloutEngine, RolloutEngine
from lightning_rlhf.engines.rollout.hf import check_hf_settings
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings, vllm_available
from lightning_rlhf.strategy.checkpoint_io import publish, temporary_sibling
from lightning_rlhf.strategy.controller import Controller
from lightning_rlhf.strategy.launcher import ExternalLauncher, RLHFLauncher, watchdog_running
from lightning_rlhf.strategy.liveness import expect_exit
from lightning_rlhf.strategy.preemption import PreemptionHandler, parse_signals

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_rlhf.module import RLHFModule

__all__ = ["RLHFStrategy"]


class RLHFStrategy(ModelParallelStrategy):
    """Single controller on rank 0, FSDP2 workers on every rank.

    Args:
        rollout: rollout engine: ``"vllm"`` (colocated vLLM, tensor-parallel inside each node), ``"hf"``
            (transformers ``generate``), or ``"auto"``: vLLM when a supported version is installed, else hf.
        vllm: settings of the vLLM engine (a :class:`~lightning_rlhf.config.VLLMConfig` or a dict of its fields).
        param_dtype: compute dtype of the sharded models (e.g. ``torch.bfloat16`` on GPUs); None keeps
            float32. Gradients are reduced in float32 either way.
        worker_error_timeout_s: after any rank reports an error, how long another rank may stay blocked in a
            collective before it ends itself (prevents hangs when a rank dies mid-collective).
        timeout: process-group timeout for collectives.
        save_distributed_checkpoint: sharded checkpoints (a folder, one file per rank); False gathers a
            single file on rank 0.
        preemption_checkpoint: when a preemption signal reaches any rank, save a checkpoint after the current
            training step before exiting with ``128 + signum`` (143 for SIGTERM, 138 for SIGUSR1). False exits
            the same way without saving.
        preemption_signals: the signals that mean "stop soon" (names or numbers); ``()`` leaves every signal to
            Lightning. These replace Lightning's own SIGTERM handling (and its SLURM SIGUSR1 requeue handler).
        preemption_path: where that checkpoint goes. None: ``<ModelCheckpoint.dirpath>/preempted.ckpt`` when a
            ModelCheckpoint has one, else ``<trainer.log_dir or default_root_dir>/checkpoints/preempted.ckpt``.
    """

    def __init__(
        self,
        rollout: Literal["auto", "hf", "vllm"] = "auto",
        *,
        vllm: VLLMConfig | dict[str, Any] | None = None,
        param_dtype: torch.dtype | None = None,
        worker_error_timeout_s: float = 60.0,
        timeout: timedelta = timedelta(minutes=30),
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        preemption_checkpoint: bool = True,
        preemption_signals: Sequence[int | str] = ("SIGTERM", "SIGUSR1"),
        preemption_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if rollout not in ("auto", "hf", "vllm"):
            raise ValueError(f"RLHFStrategy(rollout={rollout!r}) is not available. Valid: 'auto', 'hf', 'vllm'.")
        if worker_error_timeout_s <= 0:
            raise ValueError(f"RLHFStrategy(worker_error_timeout_s={worker_error_timeout_s}) must be > 0.")
        if isinstance(vllm, dict):
            vllm = config_from_dict(VLLMConfig, vllm)
        if vllm is not None and not isinstance(vllm, VLLMConfig):
            raise TypeError(f"RLHFStrategy(vllm=...) takes a VLLMConfig or a dict, got {type(vllm).__name__}.")
        if rollout == "auto":
            rollout = "vllm" if vllm_available() else "hf"
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.rollout: Literal["hf", "vllm"] = rollout
        self.vllm_config = vllm or VLLMConfig()
        self.param_dtype = param_dtype
        self.worker_error_timeout_s = worker_error_timeout_s
        self._controller: Controller | None = None
        self._max_model_len = 0
        self.preemption_checkpoint = preemption_checkpoint
        self.preemption_path = None if preemption_path is None else os.fspath(preemption_path)
        self._preemption = PreemptionHandler(parse_signals(preemption_signals))
        self._stopping = 0  # the preemption signal every rank agreed to stop on (0: none)

    # ------------------------------------------------------------------------------------- set-up
    @override
    def _configure_launcher(self) -> None:
        """Lightning's launcher whose child observer defers to our watchdog; both check ``ckpt_path`` first."""
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            self._launcher = ExternalLauncher()
        else:
            self._launcher = RLHFLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """Start the process group, a 1-D data-parallel mesh over all ranks, and the control plane."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._preemption.rank = self.global_rank
        self._preemption.install()  # a signal during loading is acted on after the first step
        super().setup_environment()
        module = self._rlhf_module()
        datamodule = getattr(module.trainer, "datamodule", None)
        engine = module.needs_rollout_engine  # False for SFTModule: no engine, no generation settings to check
        if engine and self.rollout == "hf":  # prompt + response must fit the positions, for either engine
            check_hf_settings(
                module.actor.path,
                max_prompt_length=getattr(datamodule, "max_prompt_length", None),
                max_new_tokens=module.rollout_config.max_new_tokens,
            )
        if engine and self.rollout == "vllm":  # fail on settings vLLM cannot serve before any model is loaded
            self._max_model_len = check_vllm_settings(
                module.actor.path,
                self.vllm_config,
                dtype=self.param_dtype or torch.float32,
                device_type=self.root_device.type,
                world_size=self.world_size,
                max_prompt_length=getattr(datamodule, "max_prompt_length", None),
                max_new_tokens=module.rollout_config.max_new_tokens,
            )
        launcher = self._launcher
        self._controller = Controller(
            module.get_role,
            rank=self.global_rank,
            world_size=self.world_size,
            error_timeout_s=self.worker_error_timeout_s,
            children=list(launcher.procs) if isinstance(launcher, RLHFLauncher) else None,
            stop_requested=lambda: self._preemption.requested,
        )
        watchdog_running(self.world_size > 1)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Attach the rollout engine, shard the roles with FSDP2, then let Lightning make the optimizers."""
        module = self._rlhf_module()
        # Frozen roles (reference, reward model) are in eval mode on purpose.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
        # Every rank logs the controller's values (replayed), so epoch-level metrics need no sync_dist.
        warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True\)`")
        mesh = self.device_mesh["data_parallel"]
        for name, role in module.roles().items():
            if role.model is None or role.sharded:  # a second fit() on the same module reuses the shards
                continue
            role.model.to(self.root_device)
            if name == "actor" and module.needs_rollout_engine:
                module.actor.attach_engine(self._make_engine(module))
            role.shard(mesh, param_dtype=self.param_dtype)
        super().setup(trainer)

    def _make_engine(self, module: RLHFModule) -> RolloutEngine:
        actor = module.actor.model
        assert actor is not None
        tok = module.tokenizer
        if self.rollout == "vllm":
            cfg = self.vllm_config
            module.actor.offload_optimizer = cfg.offload_optimizer and self.root_device.type == "cuda"
            return VLLMRolloutEngine(
                module.actor.path,
                param_names=[name for name, _ in actor.named_parameters()],
                config=cfg,
                dtype=self.param_dtype or torch.float32,
                device=self.root_device,
                max_model_len=self._max_model_len,
                seed=module.rollout_config.seed,
                tie_word_embeddings=bool(getattr(actor.config, "tie_word_embeddings", False)),
                hf_config=actor.config,
                eos_token_id=tok.eos_token_id,
            )
        return HFRolloutEngine(
            actor,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            device=self.root_device,
            generation_batch_size=module.rollout_config.generation_batch_size,
            dtype=self.param_dtype,
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads the whole batch: the controller splits it by each call's protocol."""
        return {"num_replicas": 1, "rank": 0}

    # -------------------------------------------------------------------------------------- a step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One RL iteration: the controller runs the dataflow, workers serve it; then count the step.

        Runs on: every rank (rank 0 as controller, others as workers).
        """
        module = self._rlhf_module()
        trainer = module.trainer
        batch = args[0]
        if isinstance(batch, Batch):
            batch.meta["step"] = trainer.global_step
        # Loggers place a step's metrics at `_batches_that_stepped`, which equals global_step here (one batch, one
        # step), except after resuming from a checkpoint saved after a validation ran on the last batch (a save
        # after fit): Lightning's restore then counts the skipped validation as one more batch.
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
        out = self._run_controlled(lambda: module.training_step(*args, **kwargs), track_stop=True)
        mark_consumed = getattr(trainer.train_dataloader, "mark_consumed", None)
        if isinstance(batch, Batch) and mark_consumed is not None:
            mark_consumed(batch)  # resumable data position = last batch trained on
        # global_step follows RL iterations, not optimizer steps (the roles step raw optimizers).
        progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        assert self._controller is not None
        if self._controller.stop_signum and not self._stopping:
            # Every rank got the same decision in the end-of-step message: Lightning's loops raise their
            # SIGTERMException at the end of this batch, after its callbacks; `on_exception` saves and sets the code.
            self._stopping = self._controller.stop_signum
            trainer._signal_connector.received_sigterm = True
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """One validation batch, routed like a training step: the controller runs the module's
        ``validation_step``, the workers serve its role calls and replay its logs. It counts no step and leaves
        the training loader's position alone.

        Runs on: every rank (rank 0 as controller, others as workers). Gradients are off but inference mode is
        left for the step: FSDP2 would otherwise allocate its unsharded parameters as inference tensors, which
        the next training step could not write to.
        """
        module = self._rlhf_module()
        batch = args[0] if args else None
        if isinstance(batch, Batch):
            batch.meta["step"] = module.trainer.global_step
        with torch.inference_mode(False), torch.no_grad():
            return self._run_controlled(lambda: module.validation_step(*args, **kwargs))

    @override
    def on_train_start(self) -> None:
        """Run one validation before the first training step when ``ValidationConfig.before_train`` is set,
        logged at the current ``global_step`` (0, or where a resumed run starts).

        Runs on: every rank, after the callbacks' and the module's ``on_train_start``.
        """
        super().on_train_start()
        self._preemption.install()  # Lightning installed its own SIGTERM handler since set-up: ours decides
        module = self._rlhf_module()
        if not module.validation_config.before_train:
            return
        trainer = module.trainer
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        val_loop.restarting = False  # a whole validation, not the rest of one a restored checkpoint had begun
        # What Lightning's training epoch loop does around a validation it runs between two steps.
        trainer.validating = True
        first_loop_iter = trainer._logger_connector._first_loop_iter
        val_loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_loop_iter
        if val_loop.skip:
            rank_zero_warn(
                "ValidationConfig.before_train=True, but there is nothing to validate on. HINT: give the datamodule "
                "validation prompts (PromptDataModule(val=...) or val_size=...); check limit_val_batches."
            )

    def _run_controlled(self, step_fn: Callable[[], Any], *, track_stop: bool = False) -> Any:
        """Rank 0 runs ``step_fn`` as the controller (recording its logs); the other ranks serve its role calls
        and replay those logs. Runs on: every rank; returns ``step_fn``'s result on rank 0, None elsewhere."""
        assert self._controller is not None
        module = self._rlhf_module()
        if self.global_rank == 0:
            module._step_logs = []
            try:
                return self._controller.run_step(step_fn, module._step_logs, track_stop=track_stop)
            finally:
                module._step_logs = None
        self._controller.serve(lambda name, value, kw: module.log(name, value, **kw))
        return None

    # --------------------------------------------------------------------------- preemption, checkpoints
    @override
    def on_validation_start(self) -> None:
        """A stop decided after a training step waits for the validation Lightning runs at that step's end."""
        super().on_validation_start()
        if self._stopping:
            self._rlhf_module().trainer._signal_connector.received_sigterm = False

    @override
    def on_validation_end(self) -> None:
        """Re-arm the stop (see ``on_validation_start``)."""
        super().on_validation_end()
        if self._stopping:
            self._rlhf_module().trainer._signal_connector.received_sigterm = True

    @override
    def on_exception(self, exception: BaseException) -> None:
        """On the stop that every rank agreed on: save the preemption checkpoint (all ranks, a collective), then
        make the exit status ``128 + signum`` (Lightning's ``SIGTERMException`` would exit with 0).

        Runs on: every rank, when Lightning's loop raises ``SIGTERMException`` at the end of the stopping step.
        """
        super().on_exception(exception)
        if not (self._stopping and isinstance(exception, SIGTERMException)):
            return
        expect_exit()  # ranks exiting now are not a fault
        trainer = self._rlhf_module().trainer
        name = signal.Signals(self._stopping).name
        code = 128 + self._stopping
        if self.preemption_checkpoint:
            path = self._preemption_ckpt_path(trainer)
            trainer.save_checkpoint(path)
            if self.global_rank == 0:
                print(
                    f"[lightning_rlhf] stopped by {name} after step {trainer.global_step}: checkpoint saved to {path}\n"
                    f"[lightning_rlhf] resume with trainer.fit(..., ckpt_path={str(path)!r}); exiting with {code}.",
                    flush=True,
                )
        elif self.global_rank == 0:
            print(
                f"[lightning_rlhf] stopped by {name} after step {trainer.global_step} without a checkpoint "
                f"(preemption_checkpoint=False); exiting with {code}.",
                flush=True,
            )
        exception.code = code

    def _preemption_ckpt_path(self, trainer: pl.Trainer) -> str:
        if self.preemption_path is not None:
            return self.preemption_path
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if dirpath:
            return os.path.join(dirpath, "preempted.ckpt")
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints", "preempted.ckpt")

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Write into ``<filepath>.tmp-<token>`` on every rank, then rank 0 syncs it and renames it to ``filepath``
        after a barrier: a run killed while saving never leaves a checkpoint that resume accepts.

        Runs on: every rank (Lightning's ``trainer.save_checkpoint`` is collective).
        """
        path = Path(self.broadcast(os.fspath(filepath)))
        tmp = temporary_sibling(path, self.broadcast(uuid.uuid4().hex[:12]))
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("lightning_rlhf.save_checkpoint.written")
        if self.global_rank == 0 and tmp.exists():
            publish(tmp, path)
        self.barrier("lightning_rlhf.save_checkpoint.published")

    @override
    def teardown(self) -> None:
        self._preemption.restore()
        from lightning_rlhf.module import RLHFModule

        if isinstance(self.lightning_module, RLHFModule):  # e.g. reward worker processes; a later fit restarts them
            for role in self.lightning_module.roles().values():
                close = getattr(role, "close", None)
                if callable(close):
                    close()
        if self._controller is not None:
            if self._controller.death is None:  # after a death the watchdog stays and still speaks for the run
                watchdog_running(False)
            self._controller.close()
        super().teardown()

    def _rlhf_module(self) -> RLHFModule:
        from lightning_rlhf.module import RLHFModule

        module = self.lightning_module
        if not isinstance(module, RLHFModule):
            raise TypeError(
                f"RLHFStrategy drives an RLHFModule, got `{type(module).__name__}`. "
                "HINT: subclass lightning_rlhf.RLHFModule (or use GRPOModule / PPOModule)."
            )
        return module
