"""``RLHFStrategy``: Lightning's FSDP2 strategy turned into HybridFlow's hybrid controller.

Rank 0 runs the module's ``training_step`` (and ``validation_step``) as the single controller and the other ranks
serve its role calls, so one ``training_step`` is one RL iteration. How it sets up, loads, shards, places roles on
rank pools, reads data and checkpoints: docs/architecture.md and docs/placement.md; faults and preemption:
docs/faults.md."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

import lightning_rlhf.cpu as cpu
from lightning_rlhf.batch import Batch
from lightning_rlhf.checkpoint.pooled import (
    complete_checkpoint,
    load_pooled_checkpoint,
    pooled_model_state,
    pooled_optimizer_state,
)
from lightning_rlhf.compat.lightning import (
    batches_that_stepped,
    check_lightning_version,
    count_optimizer_step,
    request_stop,
    run_validation_between_steps,
    set_batches_that_stepped,
    set_data_parallel_size,
    set_launcher,
)
from lightning_rlhf.compat.vllm import model_parallel_initialized
from lightning_rlhf.config import VLLMConfig, config_from_dict
from lightning_rlhf.controller.controller import Controller
from lightning_rlhf.controller.launcher import ExternalLauncher, RLHFLauncher, watchdog_running
from lightning_rlhf.controller.liveness import expect_exit
from lightning_rlhf.engines.device_layer import PLAIN, DeviceLayer
from lightning_rlhf.engines.rollout.factory import RolloutEngineFactory
from lightning_rlhf.engines.train import check_compute_dtype, resolve_dtype
from lightning_rlhf.engines.train.loading import deferred_loading
from lightning_rlhf.engines.train.ulysses import give_sequence_groups
from lightning_rlhf.perf import memory_census, memory_peaks, memory_window
from lightning_rlhf.placement.pools import Pools, check_placement_spec
from lightning_rlhf.placement.roles import bridge_pools, check_before_launch, place_roles, pool_meshes
from lightning_rlhf.strategy.checkpoint_io import check_ckpt_argument, publish, temporary_sibling
from lightning_rlhf.strategy.preemption import PreemptionHandler, parse_signals, stop_after_preemption
from lightning_rlhf.strategy.resumed_csv import ResumedMetrics

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RLHFStrategy"]


def shutdown_process_groups(grace_s: float = 0.2) -> None:
    """Destroy every process group, then leave gloo's worker threads ``grace_s`` seconds, with the GIL free, to drop the
    work objects they still hold, before the interpreter finalises. Runs on: every rank, last thing before it exits (the
    strategy's exit hook; scripts that start their own group). A gloo worker thread that releases a finished
    collective's work object while the interpreter finalises aborts the process (exit -6) after a run that succeeded;
    the core dump and the runs that measured it are in docs/faults-log.md ("A successful run that exits -6")."""
    import gc

    import torch.distributed as dist

    gc.collect()  # drop finished work objects that still reference tensors
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    gc.collect()
    time.sleep(grace_s)


@functools.cache
def _destroy_process_group_at_exit() -> None:
    """Destroy the process groups when the interpreter exits, while it is still whole (:func:`shutdown_process_groups`).
    Runs on: every rank, registered once per process at set-up. Lightning leaves the group alive (a later ``fit`` reuses
    it), so the last moment is ``atexit``. With a vLLM engine in the process, vLLM's exit hook (which runs after this
    one) destroys its own groups and the default one; destroying them here first would make it raise."""

    def destroy() -> None:
        if not model_parallel_initialized():
            shutdown_process_groups()

    atexit.register(destroy)


def _checked_arguments(
    rollout: str, vllm: Any, worker_error_timeout_s: float, placement: Any, save_distributed_checkpoint: bool
) -> VLLMConfig | None:
    """Refuse ``RLHFStrategy`` arguments that are wrong on their own or together; the vLLM settings as a
    :class:`VLLMConfig`. Runs on: the process that builds the strategy."""
    if rollout not in ("auto", "hf", "vllm"):
        raise ValueError(f"RLHFStrategy(rollout={rollout!r}) is not available. Valid: 'auto', 'hf', 'vllm'.")
    if worker_error_timeout_s <= 0:
        raise ValueError(f"RLHFStrategy(worker_error_timeout_s={worker_error_timeout_s}) must be > 0.")
    if isinstance(vllm, dict):
        vllm = config_from_dict(VLLMConfig, vllm)
    if vllm is not None and not isinstance(vllm, VLLMConfig):
        raise TypeError(f"RLHFStrategy(vllm=...) takes a VLLMConfig or a dict, got {type(vllm).__name__}.")
    check_placement_spec(placement)
    if placement is not None and not save_distributed_checkpoint:
        raise ValueError(
            "RLHFStrategy(placement=..., save_distributed_checkpoint=False): a single-file checkpoint is gathered "
            "on rank 0, which does not hold the roles placed on other ranks. HINT: keep "
            "save_distributed_checkpoint=True with a placement (`lightning-rlhf export` writes a single model)."
        )
    return vllm


def _reply_stats(module: Any) -> dict[str, float]:
    """What a rank sends with each reply: its memory peaks and, when ``module`` is given (``memory_census=True``),
    its census of the module's roles. Runs on: every rank."""
    return memory_peaks() | (memory_census(module.roles()) if module is not None else {})


class RLHFStrategy(ModelParallelStrategy):
    """Single controller on rank 0, FSDP2 workers on every rank.

    Args:
        rollout: rollout engine: ``"vllm"`` (colocated vLLM, tensor-parallel inside each node), ``"hf"``
            (transformers ``generate``), or ``"auto"``: vLLM when a supported version is installed, else hf.
        vllm: settings of the vLLM engine (a :class:`~lightning_rlhf.config.VLLMConfig` or a dict of its fields).
        param_dtype: compute dtype of the sharded models (e.g. ``torch.bfloat16``); None: float32 (gradients: float32).
        reshard_in_update: True (FSDP2's default, ZeRO-3): every forward and backward of an update gathers each
            layer's parameters and frees them after; every micro-batch's backward reduce-scatters its gradients.
            False: an update (and a scoring call, for all its micro-batches) gathers each layer once and keeps the
            full parameters (and accumulated gradients) until its end: fewer collectives (on 2 CPU processes the
            small model's update took 11-15% less, its reference forward 3-6%) for one whole model per rank.
        sharded_loading: build the roles' models on the meta device, shard them, and read only this rank's rows
            from the safetensors files (peak host memory about one shard per role). False loads every model whole
            on every rank first.
        worker_error_timeout_s: after a rank reports an error, how long another may stay blocked in a collective
            before it ends itself (no hang when a rank dies mid-collective).
        process_group_backend: the default group's backend, as Lightning's (None: NCCL on GPUs, gloo on CPU).
        save_distributed_checkpoint: sharded checkpoints (a folder, one file per rank); False: one file on rank 0.
        preemption_checkpoint: when a preemption signal reaches any rank, save a checkpoint after the current step
            before exiting with ``128 + signum`` (143 for SIGTERM, 138 for SIGUSR1). False: exit without saving.
        preemption_signals: the signals that mean "stop soon" (names or numbers), replacing Lightning's SIGTERM
            handling (and its SLURM SIGUSR1 requeue handler); ``()`` leaves every signal to Lightning.
        preemption_path: where that checkpoint goes. None: ``<ModelCheckpoint.dirpath>/preempted.ckpt`` when a
            ModelCheckpoint has one, else ``<trainer.log_dir or default_root_dir>/checkpoints/preempted.ckpt``.
        placement: where each role runs. None: every role on every rank. A mapping from role names to lists of
            ranks places roles on pools of their own (docs/placement.md): roles with the same ranks are colocated,
            and calls to disjoint pools made inside ``RLHFModule.concurrently()`` run at the same time. ``"auto"``:
            the planner's choice for this world (:mod:`lightning_rlhf.placement`; resolved there at set-up).
        cpu_kernels: the CPU speed layer (:mod:`lightning_rlhf.cpu`). None: ``LIGHTNING_RLHF_CPU_KERNELS``
            (``1``/``0``) where set, else on only when the run's device is a CPU. False turns all of it off
            (PyTorch's own ops: the same results up to float rounding); True forces it on.
        engine_factory: what builds the rollout engines the roles ask for (it also checks their settings first);
            None: a :class:`~lightning_rlhf.engines.rollout.RolloutEngineFactory` of ``rollout`` and ``vllm``.
        memory_census: each rank reports the bytes of each role's parameters, gradients and optimizer state
            (``perf/memory_held_gb/<role>/<part>``, docs/metrics.md; a microsecond a tensor, so off unless asked).
    """

    def __init__(
        self,
        rollout: Literal["auto", "hf", "vllm"] = "auto",
        *,
        vllm: VLLMConfig | dict[str, Any] | None = None,
        param_dtype: torch.dtype | str | None = None,
        reshard_in_update: bool = True,
        sharded_loading: bool = True,
        worker_error_timeout_s: float = 60.0,
        timeout: timedelta = timedelta(minutes=30),
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        preemption_checkpoint: bool = True,
        preemption_signals: Sequence[int | str] = ("SIGTERM", "SIGUSR1"),
        preemption_path: str | os.PathLike[str] | None = None,
        placement: Mapping[str, Sequence[int]] | Literal["auto"] | None = None,
        cpu_kernels: bool | None = None,
        engine_factory: RolloutEngineFactory | None = None,
        memory_census: bool = False,
    ) -> None:
        check_lightning_version()  # the internals this strategy uses (compat.lightning) are checked per version
        vllm = _checked_arguments(rollout, vllm, worker_error_timeout_s, placement, save_distributed_checkpoint)
        cpu.configure(cpu_kernels, None)  # checks the value; the device is known at set-up
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip
        self.vllm_config = vllm or VLLMConfig()
        self.engine_factory = engine_factory or RolloutEngineFactory(rollout, self.vllm_config)
        self.rollout: Literal["hf", "vllm"] = self.engine_factory.kind
        self._vllm_tp = self.vllm_config.tensor_parallel_size if self.rollout == "vllm" else None  # None: no vLLM
        self.param_dtype = resolve_dtype(param_dtype, setting="RLHFStrategy.param_dtype")
        self.sharded_loading = sharded_loading
        self.sharded_checkpoints = save_distributed_checkpoint
        self.reshard_in_update = reshard_in_update
        self.worker_error_timeout_s = worker_error_timeout_s
        self._controller: Controller | None = None
        self._layer: DeviceLayer = PLAIN  # the device layer, chosen at set-up (setup_environment)
        self.preemption_checkpoint = preemption_checkpoint
        self.preemption_path = None if preemption_path is None else os.fspath(preemption_path)
        self._preemption = PreemptionHandler(parse_signals(preemption_signals))
        self._stopping = 0  # the preemption signal every rank agreed to stop on (0: none)
        self._logger_step: int | None = None  # the loggers' step counter while a validation runs
        self.placement = placement
        self.cpu_kernels = cpu_kernels
        self.memory_census = memory_census
        self._pools: Pools = {}
        self._placed = False  # whether some role is not on every rank (checkpoints then save each from its pool)
        self._meshes: dict[str, Any] = {}  # role -> the FSDP mesh of its pool (roles this rank holds)

    @override
    def _configure_launcher(self) -> None:
        """Lightning's launcher whose child observer defers to our watchdog; both check ``ckpt_path`` first."""
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            set_launcher(self, ExternalLauncher(checks=[check_ckpt_argument]))
        else:
            check = functools.partial(  # what the ranks would refuse at set-up, before any rank starts
                check_before_launch, spec=self.placement, world_size=self.num_processes * self.num_nodes,
                processes_per_node=self.num_processes, vllm_tp=self._vllm_tp,
            )  # fmt: skip
            checks = [check_ckpt_argument, lambda arguments, fitting: check(arguments.get("model"), fitting)]
            launcher = RLHFLauncher(self.cluster_environment, self.num_processes, self.num_nodes, checks=checks)
            set_launcher(self, launcher)

    @override
    def setup_environment(self) -> None:
        """Start the process group, a 1-D data-parallel mesh over all ranks, the roles' pools (and their meshes), and
        the control plane; check the dtypes and the rollout engines' settings before any model loads."""
        set_data_parallel_size(self, self.num_nodes * self.num_processes)
        self._preemption.rank = self.global_rank
        self._preemption.install()  # a signal during loading is acted on after the first step
        super().setup_environment()
        _destroy_process_group_at_exit()
        module = self._rlhf_module()
        ResumedMetrics.install(module.trainer)  # a resume keeps its metrics.csv
        self._layer = cpu.device_layer(self.cpu_kernels, self.root_device)  # before any model is built
        check_compute_dtype(self.param_dtype, self.root_device, setting="RLHFStrategy.param_dtype")
        for role in module.roles().values():  # the layer to every engine; trainable roles hold float32 master weights
            role.train_engine.layer = self._layer
            if not role.trainable:
                check_compute_dtype(role.dtype, self.root_device, setting="RLHFModule.frozen_dtype")
        datamodule = getattr(module.trainer, "datamodule", None)
        max_prompt_length = getattr(datamodule, "max_prompt_length", None)
        # The placement package resolves the placement and bridges its pools, before any model loads (every rank
        # builds the pools' groups and meshes in the same order).
        self._pools = place_roles(
            module, self.placement, world_size=self.world_size, rank=self.global_rank, device=self.root_device,
            processes_per_node=self.num_processes, vllm_tp=self._vllm_tp, broadcast=self.broadcast,
            fitting=module.trainer.state.fn == "fit",
        )  # fmt: skip
        self._placed = any(len(ranks) < self.world_size for ranks in self._pools.values())
        bridge_pools(module.roles(), self._pools, rank=self.global_rank, device=self.root_device)
        self._meshes = pool_meshes(self._pools, self.device_mesh["data_parallel"], rank=self.global_rank)
        for name, role in module.roles().items():
            request = role.rollout_engine_request()  # None: no engine, no generation settings to check (e.g. SFT)
            if request is not None:  # fail on settings the engine cannot serve before any model is loaded
                self.engine_factory.check(
                    request, max_prompt_length=max_prompt_length, dtype=self.param_dtype, device=self.root_device,
                    world_size=len(self._pools.get(name, range(self.world_size))),
                    processes_per_node=self.num_processes,
                )  # fmt: skip
        launcher = self.launcher
        self._controller = Controller(
            lambda name: module.roles()[name], rank=self.global_rank, world_size=self.world_size,
            error_timeout_s=self.worker_error_timeout_s, stop_requested=lambda: self._preemption.requested,
            children=list(launcher.procs) if isinstance(launcher, RLHFLauncher) else None, pools=self._pools,
            groups={role: mesh.get_group() for role, mesh in self._meshes.items() if mesh.size() < self.world_size},
            reply_stats=functools.partial(_reply_stats, module if self.memory_census else None),
            call_window=memory_window,
        )  # fmt: skip
        watchdog_running(self.world_size > 1)

    @property
    def pools(self) -> Pools:
        """Each role's ranks (after set-up). Runs on: every process."""
        return dict(self._pools)

    def holds(self, role: str) -> bool:
        """Whether this rank holds ``role`` (is in its pool). Runs on: every process, after set-up."""
        return self.global_rank in self._pools.get(role, range(self.world_size))

    @property
    def _by_role(self) -> bool:
        """Whether checkpoints are written and read role by role (``checkpoint.pooled``): with a placement, and for
        a sharded checkpoint of a run with LoRA adapters (whose frozen base weights stay out of it)."""
        roles = getattr(self.lightning_module, "roles", None)
        lora = callable(roles) and any(getattr(role, "lora", None) is not None for role in roles().values())
        return self._placed or (self.sharded_checkpoints and lora)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Around ``configure_model``: with ``sharded_loading``, roles build their models with parameters on the
        meta device; :meth:`setup` shards them and reads each rank's rows from the checkpoint files."""
        with super().tensor_init_context(empty_init), deferred_loading(self.sharded_loading):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Give each role what it declares it needs (a rollout engine; float32 master weights computed in
        ``param_dtype`` when trainable), shard its model with FSDP2 and load this rank's shards, then let Lightning make
        the optimizers. Runs on: every rank, after ``configure_model``."""
        module = self._rlhf_module()
        # Frozen roles (reference, reward model) are in eval mode on purpose.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
        # Every rank logs the controller's values (replayed), so epoch-level metrics need no sync_dist.
        warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True\)`")
        give_sequence_groups(module.roles(), self._pools, world_size=self.world_size, rank=self.global_rank)
        for name, role in module.roles().items():
            if role.model is None or role.sharded:  # a second fit() on the same module reuses the shards
                continue
            if not self.holds(name):  # built anyway (e.g. in a role's __init__): another pool holds it, drop it here
                role.set_model(None)
                continue
            request = role.rollout_engine_request()
            if request is not None:
                engine = self.engine_factory(
                    request, model=role.model, device=self.root_device, dtype=self.param_dtype,
                    pool=self._pools.get(name), rank=self.global_rank, world_size=self.world_size,
                    pool_group=self._meshes[name].get_group(), layer=self._layer,
                )  # fmt: skip
                role.attach_engine(engine)
            role.shard(self._meshes[name], param_dtype=self.param_dtype)
            role.train_engine.reshard_in_update = self.reshard_in_update
            role.materialize(self.root_device)
        super().setup(trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads the whole batch: the controller splits it by each call's protocol."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Keep the batch in host memory: it is the controller's data, not a model input (workers move the columns
        they read to their device; engine outputs come back to the host, and a mix would fail in the first scoring
        call). The module's batch-transfer hooks still run, to the host. Runs on: every rank (Lightning's loops)."""
        return super().batch_to_device(batch, torch.device("cpu"), dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One RL iteration: the controller runs the dataflow, workers serve it; then count the step. Runs on: every
        rank (rank 0 as controller, others as workers)."""
        module = self._rlhf_module()
        trainer = module.trainer
        batch = args[0]
        if isinstance(batch, Batch):
            batch.meta["step"] = trainer.global_step
        # Loggers place a step's metrics at `_batches_that_stepped`, which equals global_step here (one batch, one
        # step), except after resuming from a checkpoint saved after a validation ran on the last batch (a save
        # after fit): Lightning's restore then counts the skipped validation as one more batch.
        set_batches_that_stepped(trainer, trainer.global_step)
        out = self._run_controlled(lambda: module.training_step(*args, **kwargs), track_stop=True)
        mark_consumed = getattr(trainer.train_dataloader, "mark_consumed", None)
        if isinstance(batch, Batch) and mark_consumed is not None:
            mark_consumed(batch)  # resumable data position = last batch trained on
        # global_step follows RL iterations, not optimizer steps (the roles step raw optimizers).
        count_optimizer_step(trainer)
        assert self._controller is not None
        if self._controller.stop_signum and not self._stopping:
            # Every rank got the same decision in the end-of-step message: Lightning's loops raise their
            # SIGTERMException at the end of this batch, after its callbacks; `on_exception` saves and sets the code.
            self._stopping = self._controller.stop_signum
            request_stop(trainer, True)
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """One validation batch, routed like a training step (it counts no step, leaves the loader's position alone).
        Runs on: every rank. Gradients are off but inference mode is left: FSDP2 would otherwise allocate its
        unsharded parameters as inference tensors, which the next training step could not write to."""
        module = self._rlhf_module()
        batch = args[0] if args else None
        if isinstance(batch, Batch):
            batch.meta["step"] = module.trainer.global_step
        with torch.inference_mode(False), torch.no_grad():
            return self._run_controlled(lambda: module.validation_step(*args, **kwargs))

    @override
    def on_train_start(self) -> None:
        """Run one validation before the first training step when ``ValidationConfig.before_train`` is set, logged
        at the current ``global_step``. Runs on: every rank, after the callbacks' and the module's hook."""
        super().on_train_start()
        self._preemption.install()  # Lightning installed its own SIGTERM handler since set-up: ours decides
        module = self._rlhf_module()
        if not module.validation_config.before_train:
            return
        # A whole validation (not the rest of one a restored checkpoint had begun), run the way Lightning's training
        # epoch loop runs one between two steps.
        if not run_validation_between_steps(module.trainer):
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
            with module.recording_logs() as logs:
                return self._controller.run_step(step_fn, logs, track_stop=track_stop)
        self._controller.serve(lambda name, value, kw: module.log(name, value, **kw))
        return None

    @override
    def on_validation_start(self) -> None:
        """Make the loggers place this validation's metrics at ``global_step``, the step of the weights it measures
        (Lightning's batch counter is one behind between two steps; a metric named ``step`` would also reach
        ``ModelCheckpoint``'s file names), and hold a stop decided after a step for this validation. Runs on: every
        rank."""
        super().on_validation_start()
        trainer = self._rlhf_module().trainer
        self._logger_step = batches_that_stepped(trainer)
        set_batches_that_stepped(trainer, trainer.global_step)
        if self._stopping:
            request_stop(trainer, False)

    @override
    def on_validation_end(self) -> None:
        """Give the loggers back their step counter, and re-arm the stop (see ``on_validation_start``)."""
        super().on_validation_end()
        trainer = self._rlhf_module().trainer
        if self._logger_step is not None:
            set_batches_that_stepped(trainer, self._logger_step)
            self._logger_step = None
        if self._stopping:
            request_stop(trainer, True)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """On the stop that every rank agreed on: save the preemption checkpoint (all ranks, a collective), then make
        the exit status ``128 + signum`` (Lightning's ``SIGTERMException`` would exit with 0). Runs on: every rank, when
        Lightning's loop raises ``SIGTERMException`` at the end of the stopping step."""
        super().on_exception(exception)
        if not (self._stopping and isinstance(exception, SIGTERMException)):
            return
        expect_exit()  # ranks exiting now are not a fault
        path = self.preemption_path if self.preemption_checkpoint else False
        exception.code = stop_after_preemption(self._rlhf_module().trainer, self._stopping, path, rank=self.global_rank)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Write into ``<filepath>.tmp-<token>`` on every rank (with what ``checkpoint.pooled.complete_checkpoint``
        adds), then rank 0 syncs it and renames it to ``filepath`` after a barrier: a run killed while saving never
        leaves a checkpoint that resume accepts. Runs on: every rank (``trainer.save_checkpoint`` is collective)."""
        path = Path(self.broadcast(os.fspath(filepath)))
        tmp = temporary_sibling(path, self.broadcast(uuid.uuid4().hex[:12]))
        complete_checkpoint(checkpoint, self._rlhf_module(), self._pools if self._placed else None)
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("lightning_rlhf.save_checkpoint.written")
        if self.global_rank == 0 and tmp.exists():
            publish(tmp, path)
        self.barrier("lightning_rlhf.save_checkpoint.published")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state for a checkpoint; with a placement, only what this rank holds, and with LoRA, no frozen
        base weights (``checkpoint.pooled``). Runs on: every rank."""
        return pooled_model_state(self._rlhf_module()) if self._by_role else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """One optimizer's state for a checkpoint; with a placement, relative to its role's model (empty on a rank
        outside the role's pool). Runs on: every rank."""
        return (
            pooled_optimizer_state(self._rlhf_module(), optimizer)
            if self._by_role
            else super().optimizer_state(optimizer)
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore a checkpoint; with a placement, each rank reads the part it holds (with LoRA, adapters and their
        optimizer state on top of the base the run loaded). Runs on: every rank."""
        if not self._by_role:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path, module = Path(self.broadcast(os.fspath(checkpoint_path))), self._rlhf_module()
        return load_pooled_checkpoint(
            path, module, self.optimizers, strict=module.strict_loading, weights_only=weights_only
        )

    @override
    def teardown(self) -> None:
        self._preemption.restore()
        roles = getattr(self.lightning_module, "roles", None)
        if callable(roles):  # e.g. reward worker processes; a later fit restarts them
            for role in roles().values():
                role.close()
        if self._controller is not None:
            if self._controller.death is None:  # after a death the watchdog stays and still speaks for the run
                watchdog_running(False)
            self._controller.close()
        self._layer.release()
        super().teardown()

    def take_memory(self) -> tuple[dict[int, dict[str, float]], dict[str, dict[int, dict[str, float]]]]:
        """Each rank's :func:`~lightning_rlhf.perf.memory_peaks` (and census) at its latest reply, and each role
        call's :func:`~lightning_rlhf.perf.memory_window` per rank since the last take. Runs on: controller."""
        if self._controller is None:
            return {}, {}
        calls, self._controller.call_memory = self._controller.call_memory, {}
        return dict(self._controller.memory_peaks), calls

    def _rlhf_module(self) -> Any:
        """The module, an ``RLHFModule`` (known by its ``roles()``: the strategy does not import the module)."""
        module = self.lightning_module
        if not callable(getattr(module, "roles", None)):
            raise TypeError(
                f"RLHFStrategy drives an RLHFModule, got `{type(module).__name__}`. "
                "HINT: subclass lightning_rlhf.RLHFModule (or use GRPOModule / PPOModule)."
            )
        return module
