"""`Worker`: one per device rank; owns the device, the model runner and the memory budget.

The seed's chapter 4. Every rank runs every forward (tensor-parallel ranks must all join the
collectives); only the driver rank (TP rank 0 of the last pipeline stage) returns a
`ModelRunnerOutput`. A pipeline stage that is not last sends its hidden states on to the
next stage's rank instead, and a later stage receives them before its forward.
"""

from __future__ import annotations

import gc
import logging
import os
from collections import deque
from collections.abc import Iterable

import torch

from pagoda.config import EngineConfig
from pagoda.cpu_platform import configure_cpu_threads
from pagoda.distributed.parallel_state import init_distributed_environment, pp_recv, pp_send
from pagoda.kv_cache_interface import KVCacheConfig, KVCacheSpec
from pagoda.model.loader.model_loader import check_weights_complete, iter_checkpoint_weights
from pagoda.outputs import AsyncModelRunnerOutput, IntermediateTensors, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput
from pagoda.worker.gpu_model_runner import GPUModelRunner
from pagoda.worker.tagged_memory import TaggedMemoryPool

logger = logging.getLogger(__name__)

GiB = 1 << 30

WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"
SLEEP_TAGS = (WEIGHTS_TAG, KV_CACHE_TAG)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str | None,
        is_driver_worker: bool = False,
        return_hidden_states: bool = False,
        in_process: bool = False,
    ) -> None:
        """`in_process`: the engine core calls this worker on its own thread and resolves its
        outputs there, so a step may leave its sampling to the next call
        (`GPUModelRunner.defers_sampling`); worker processes send outputs from another thread."""
        self.config = config
        self.parallel_config = config.parallel_config
        self.scheduler_config = config.scheduler_config
        self.device_config = config.device_config
        self.cache_config = config.cache_config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        # Pipeline stages that are not last hand hidden states on instead of sampling.
        self.return_hidden_states = return_hidden_states
        self.in_process = in_process
        self.model_runner: GPUModelRunner | None = None
        self.memory_pool: TaggedMemoryPool | None = None
        self.device: torch.device | None = None
        # Set by sleep(level=2): the weights tag then restores zeros and must be refilled.
        self._weights_need_reload = False
        # The runner's last output while its sampled ids may be in flight; resolved once the
        # next step is launched, so every rank's token history fills in (not only the driver's).
        self._unresolved: deque[AsyncModelRunnerOutput] = deque()
        # Device bytes in use outside torch's allocator when this worker took the device (other
        # processes', this one's CUDA context): not this engine's to budget.
        self._used_at_start = 0

    def init_device(self) -> None:
        if self.device_config.is_cuda:
            # Must be set before the first CUDA allocation to take effect.
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
            self._used_at_start = self._check_free_memory()
        else:
            self.device = torch.device("cpu")
            # Tiny activations (random dummy weights, long residual chains) turn denormal and make
            # CPU matmuls crawl; flushing them to zero changes no result that matters.
            torch.set_flush_denormal(True)
            configure_cpu_threads(self._cpu_threads_per_rank())
        init_distributed_environment(
            self.rank,
            self.parallel_config.tensor_parallel_size,
            self.parallel_config.pipeline_parallel_size,
            self.distributed_init_method,
            self.device,
            one_shot_all_reduce=not self.parallel_config.disable_custom_all_reduce,
        )
        torch.manual_seed(self.config.model_config.seed)
        # Weights and KV cache in tagged memory only when sleep mode may release them.
        self.memory_pool = TaggedMemoryPool(self.device) if self.cache_config.enable_sleep_mode else None
        self.model_runner = GPUModelRunner(self.config, self.device, self.memory_pool)
        self.model_runner.defers_sampling = self.in_process

    def _check_free_memory(self) -> int:
        """Device bytes in use outside this process's torch allocator (other processes', this
        one's CUDA context), after checking the rest can hold this engine's share. Memory torch
        holds cached but unallocated counts as free."""
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        self._require_share(free + reserved - torch.cuda.memory_allocated(), total)
        return total - free - reserved

    def _require_share(self, usable: int, total: int) -> None:
        """Refuse to start where `usable` bytes cannot hold the share `gpu_memory_utilization`
        asks for: the engine would size its KV cache into memory others hold."""
        wanted = total * self.cache_config.gpu_memory_utilization
        if usable < wanted:
            raise ValueError(
                f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} asks for "
                f"{wanted / GiB:.2f} GiB of cuda:{self.local_rank}, but only {usable / GiB:.2f} GiB of its "
                f"{total / GiB:.2f} GiB are free (other processes hold the rest): lower it"
            )

    def _cpu_threads_per_rank(self) -> int:
        """Local processes (the "mp" executor) share the host's `cpu_threads`: each rank takes
        its part (at least one), so together they never run more threads than the cores."""
        threads = self.device_config.cpu_threads
        assert threads is not None  # resolved by DeviceConfig
        local_ranks = (
            self.parallel_config.world_size if self.parallel_config.distributed_executor_backend == "mp" else 1
        )
        return max(1, threads // local_ranks)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take on this device.

        CUDA: total x gpu_memory_utilization minus the peak of a profile run (weights, LoRA
        slots included, and the largest batch's activations, sampler included), the memory this
        engine holds outside torch's allocator, and what the CUDA graphs will take (measured on
        scratch captures); what the device held when the worker took it (another engine sharing
        the GPU) is not counted, so two engines at 0.4 each fit on one device. CPU:
        the configured `cpu_kv_cache_gib`.
        """
        assert self.model_runner is not None
        if not self.device_config.is_cuda:
            return int(self.cache_config.cpu_kv_cache_gib * GiB)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # The model and the runner's static buffers; tagged weights live outside torch's
        # allocator and so count as non-torch memory below.
        tagged_weights = self.memory_pool.nbytes("weights") if self.memory_pool is not None else 0
        weights = torch.cuda.memory_allocated() + tagged_weights
        self.model_runner.profile_run()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        # What this engine holds outside torch's allocator since it took the device: the tagged
        # weights, NCCL's buffers; other processes' memory stays out of its budget.
        non_torch = (total - free) - torch.cuda.memory_reserved() - self._used_at_start
        torch.cuda.empty_cache()
        graphs = self.model_runner.profile_cudagraph_memory()
        available = int(total * self.cache_config.gpu_memory_utilization - peak - non_torch - graphs)
        lora_manager = self.model_runner.lora_manager
        logger.info(
            "memory: total %.2f GiB x utilization %.2f; weights %.2f GiB (LoRA slots %.2f GiB), peak activations "
            "%.2f GiB, non-torch %.2f GiB, CUDA graphs %.2f GiB (estimated); KV cache gets %.2f GiB",
            total / GiB,
            self.cache_config.gpu_memory_utilization,
            weights / GiB,
            (lora_manager.nbytes if lora_manager is not None else 0) / GiB,
            (peak + tagged_weights - weights) / GiB,
            (non_torch - tagged_weights) / GiB,
            graphs / GiB,
            available / GiB,
        )
        return available

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """{layer name: what it keeps in the KV cache} for this rank's layers."""
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Take this rank's layout from the executor's list (one per rank, rank order)."""
        self.initialize_kv_cache(kv_cache_configs[self.rank])

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        """Capture CUDA graphs once the KV cache exists (they read its addresses)."""
        assert self.model_runner is not None
        self.model_runner.capture_model()

    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """Every rank runs the step; the driver returns its output, the others None."""
        runner = self.model_runner
        assert runner is not None
        if intermediate_tensors is None and not runner.is_first_stage and not scheduler_output.is_empty:
            intermediate_tensors = runner.intermediate_tensors(runner.num_input_tokens(scheduler_output))
            pp_recv(intermediate_tensors.tensors())
        output = runner.execute_model(scheduler_output, intermediate_tensors)
        if self.return_hidden_states:
            if isinstance(output, IntermediateTensors):  # (an empty step sends nothing)
                pp_send(output.tensors())
            return None
        if self._unresolved:
            self._unresolved.popleft().get_output()
        if isinstance(output, AsyncModelRunnerOutput):
            self._unresolved.append(output)
        return output if self.is_driver_worker else None

    def shutdown(self) -> None:
        """Let go of the model, the KV cache and the runner's buffers, and hand the device
        memory back (also to the driver: torch's allocator would keep the freed blocks). The
        model and the runner sit in reference cycles (a parameter's weight_loader is a bound
        method of its module; a step's async output holds one of the runner's), which only the
        cyclic collector frees."""
        if self.device_config.is_cuda and self.device is not None:
            # A step may still run (async scheduling queues one ahead). torch's allocator would
            # order the reuse of its memory after it, but sleep mode's tagged memory (weights,
            # KV cache) is unmapped the moment its last tensor goes.
            torch.cuda.synchronize(self.device)
        if self.model_runner is not None:
            self.model_runner.kv_connector.shutdown()
        self.model_runner = None
        self.memory_pool = None
        self._unresolved.clear()
        gc.collect()
        if self.device_config.is_cuda:
            torch.cuda.empty_cache()

    def check_idle(self) -> None:
        """Raise AssertionError unless the runner holds no request."""
        runner = self.model_runner
        assert runner is not None
        assert not runner.requests, f"runner still holds {list(runner.requests)}"
        assert runner.input_batch.num_reqs == 0, "runner batch not empty"
        runner.kv_connector.check_idle()
        if runner.encoder_runner is not None:
            runner.encoder_runner.check_idle()

    # ---- sleep mode ------------------------------------------------------------------------

    def _sleep_pool(self) -> TaggedMemoryPool:
        if self.memory_pool is None:
            raise RuntimeError("sleep mode is off: build the engine with enable_sleep_mode=True")
        return self.memory_pool

    def sleeping_tags(self) -> list[str]:
        """The tags whose device memory is released now (empty when awake or without sleep mode)."""
        if self.memory_pool is None:
            return []
        return [tag for tag in SLEEP_TAGS if self.memory_pool.is_released(tag)]

    def sleep(self, level: int) -> None:
        """Hand the device memory back: level 1 offloads the weights to pinned CPU memory and
        drops the KV cache; level 2 drops both (wake_up reloads the weights from their source).
        Tags already asleep stay as they are."""
        pool = self._sleep_pool()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 2 and self.config.model_config.gguf_weights == "quantized":
            raise ValueError(
                "sleep level 2 reloads the weights from the GGUF, which the int4 layers of gguf_weights "
                "'quantized' cannot take in place (they hold packed weights): use level 1, or gguf_weights='dequantized'"
            )
        awake = [tag for tag in SLEEP_TAGS if not pool.is_released(tag)]
        if not awake:
            raise RuntimeError("the worker is already asleep: call wake_up first")
        if WEIGHTS_TAG in awake:
            pool.release(WEIGHTS_TAG, offload=level == 1)
            self._weights_need_reload = level == 2
        if KV_CACHE_TAG in awake:
            pool.release(KV_CACHE_TAG, offload=False)
        if self.device_config.is_cuda:
            torch.cuda.empty_cache()  # torch's cached free blocks go back too, so mem_get_info shows it

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Give `tags` (default: every sleeping tag) device memory again at the same addresses,
        so CUDA graphs stay valid. The KV cache comes back zeroed: its contents are gone."""
        pool = self._sleep_pool()
        sleeping = self.sleeping_tags()
        if tags is None:
            if not sleeping:
                raise RuntimeError("the worker is not asleep: nothing to wake up")
            tags = sleeping
        for tag in tags:
            if tag not in SLEEP_TAGS:
                raise ValueError(f"unknown sleep tag {tag!r}; tags are {list(SLEEP_TAGS)}")
            if tag not in sleeping:
                raise RuntimeError(f"tag {tag!r} is awake: only sleeping tags ({sleeping}) can be woken")
        if WEIGHTS_TAG in tags:
            pool.restore(WEIGHTS_TAG)
            if self._weights_need_reload:
                self.model_runner.reload_weights()
                self._weights_need_reload = False
        if KV_CACHE_TAG in tags:
            pool.restore(KV_CACHE_TAG)

    def update_weights(self, weights: str | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy new weights into the parameters in place; returns the HF names loaded.

        `weights`: a checkpoint path (an HF safetensors directory or a .gguf file), which must
        fill every parameter, or (HF name, tensor) pairs named as in a checkpoint, any subset.
        Unknown names and shape mismatches raise ValueError naming the weight; tensors copied
        before the bad one stay copied.
        """
        assert self.model_runner is not None
        if WEIGHTS_TAG in self.sleeping_tags():
            raise RuntimeError("the weights are asleep: call wake_up(['weights']) before update_weights")
        if isinstance(weights, str):
            hf_config = self.config.model_config.hf_config
            loaded = self.model_runner.load_weights(iter_checkpoint_weights(weights, hf_config))
            check_weights_complete(self.model_runner.model, loaded, weights)
        else:
            loaded = self.model_runner.load_weights(weights)
        if self.device_config.is_cuda:
            torch.cuda.synchronize(self.device)  # the host tensors may be reused once this returns
        return sorted(loaded)
