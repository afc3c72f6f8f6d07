"""The plain data the memory code works on: what is trained and how (`Options`), the precision
rules of its forward pass (`Mode`), the strategy of a column of the estimate (`Column`), and one
parameter of the model (`ParamSpec`, read from the model by `toolkit.memory.parameters`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from toolkit.models.config import Config

GiB = 1024**3

# Strategy columns, cheapest communication first: the order the recommendation tries them in.
COLUMN_ORDER = ("single", "DDP", "NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD")


@dataclass(frozen=True)
class Column:
    name: str  # "single", "DDP" or an FSDP sharding strategy
    kind: Literal["single", "ddp", "fsdp"]
    shard_size: int  # devices each FSDP unit is sharded over (1 = replicated)


def make_column(name: str, devices: int, num_nodes: int) -> Column:
    """The column for "single", "DDP" or an FSDP sharding on devices x num_nodes."""
    if name == "single":
        return Column(name, "single", 1)
    if name == "DDP":
        return Column(name, "ddp", 1)
    from toolkit.parallel.plan import mesh_layout  # the mesh training builds

    shape, dims = mesh_layout(name, num_nodes, devices)
    return Column(name, "fsdp", shape[dims.index("shard")])


@dataclass
class Options:
    """What is being trained, and how (everything but the strategy and the micro batch)."""

    config: Config
    precision: str
    finetune: Optional[str]
    lora_modules: tuple[str, ...]
    lora_r: int
    quantize: Optional[str]
    max_seq_length: int
    # Whose rules: "cuda" (a GPU run); "cpu" (a real CPU run: the CPU's kernels, the fused loss's
    # buffers kept between calls, gloo's staging of all-gathers; the tests' real runs); "fake"
    # (the CPU's kernels on fake tensors, allocating as on a GPU: `toolkit.memory.simulation`).
    device: Literal["cuda", "cpu", "fake"] = "cuda"
    lora_dropout: float = 0.0
    cpu_offload: bool = False  # FSDP's CPUOffloadPolicy: shards, gradients and AdamW state in host memory
    # A preference objective (DPO and the like): each sample is a pair, two rows (chosen, rejected)
    # in one forward pass, and the head gives each token's log-probability (`GPT.forward(per_token=True)`).
    pairs: bool = False
    # Full fine-tuning against a live reference (DPO, IPO): a frozen copy of the model, stored in
    # the compute dtype and sharded like the trained one. LoRA's reference is its own base with the
    # adapters off, reference-free losses and precomputed references need none.
    frozen_copy: bool = False
    # Expert parallelism (`--distributed.expert_parallel N`, FSDP only): each MoE layer's experts split
    # over N ranks of the shard group, each rank's experts sharded by FSDP over the other
    # shard_size / N ranks (`toolkit.memory.parameters.run_specs`), tokens sent to their experts'
    # ranks and back by all-to-alls (`Activations.all_to_all`).
    expert_parallel: int = 1

    @property
    def rows_per_sample(self) -> int:
        return 2 if self.pairs else 1

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "32-true" else 2

    @property
    def trainable_bytes(self) -> int:
        """Bytes per element of a trainable weight, its gradient and its AdamW state (float32 but
        under "*-true" 16-bit precision); also of the gradient reduction under FSDP."""
        return self.compute_bytes if self.precision.endswith("-true") else 4

    @property
    def frozen_bytes(self) -> int:
        """Bytes per element of a frozen weight: stored in the compute dtype."""
        return self.compute_bytes

    def param_bytes(self, s: ParamSpec) -> int:
        return self.trainable_bytes if s.trainable else self.frozen_bytes

    def gathered_bytes(self, s: ParamSpec, column: "Column") -> int:
        """Bytes per element of `s` as the forward and backward passes see it: as stored, but under
        FSDP with "*-mixed" every unit (blocks, embedding, final norm, head) casts its float32
        shards to the compute dtype before the all-gather (the MixedPrecisionPolicy of
        toolkit.parallel.fsdp.shard_model). The embedding's output is cast back to its stored
        dtype (`toolkit.memory.activations` records it so)."""
        if column.kind == "fsdp" and self.autocast:
            return self.compute_bytes
        return self.param_bytes(s)

    @property
    def autocast(self) -> bool:
        return self.precision.endswith("-mixed")

    def mode(self) -> "Mode":
        """The precision and kernel rules of the forward pass."""
        return Mode(self.autocast, self.compute_bytes, self.device, self.lora_dropout > 0, self.precision.startswith("16-"))


@dataclass(frozen=True)
class Mode:
    """The precision rules of the forward pass."""

    autocast: bool  # *-mixed: matmuls in 16 bits under torch.autocast
    compute: int  # bytes of the compute dtype
    device: Literal["cuda", "cpu", "fake"] = "cuda"  # whose rules: see `Options.device`
    lora_dropout: bool = False  # adapters apply dropout to their input
    float16: bool = False  # the 16-bit compute dtype is float16 (not bfloat16)

    @property
    def cuda(self) -> bool:
        """CUDA's kernels (dropout keeps a bool mask); else the CPU's, fake tensors included."""
        return self.device == "cuda"

    @property
    def real_cpu(self) -> bool:
        """Real CPU tensors: the fused loss keeps its chunk buffers between calls
        (`toolkit.models.gpt._scratch`), and a cast on writing goes through a temporary."""
        return self.device == "cpu"


# Where a parameter lives among FSDP's units: a block; the input edge (the embedding); an output
# edge before the last one (the final norm); the last output edge (the head, which computes the
# loss); or the root (a tied embedding and head, and whatever else no unit claims).
Group = Literal["block", "input", "output", "head", "root"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model as built (after LoRA injection), in registration order."""

    name: str  # as in GPT.named_parameters() (peft's wrapping included)
    shape: tuple[int, ...]
    unit: int  # the block index, or -1 outside the blocks
    trainable: bool
    # router: a mixture's router (kept in 16 bits under QLoRA); experts: a mixture's 3-D weights and biases
    kind: Literal["embedding", "linear", "bias", "norm", "lora", "router", "experts"]
    group: Group = "root"
    # Ranks the tensor's experts (dim 0) are split over: `shape` is one rank's part, which FSDP
    # shards over `shard_group(shard_size)` ranks (`toolkit.memory.parameters.run_specs`).
    expert_parallel: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_group(self, shard_size: int) -> int:
        """Ranks FSDP shards this tensor over, in a shard group of `shard_size`."""
        return shard_size // self.expert_parallel
