"""`toolkit finetune_lora` (and QLoRA with --quantize), and `toolkit merge_lora`.

LoRA comes from `peft`, applied to the toolkit's own model: peft swaps the chosen Linear layers for
its LoRA layers; the base weights are frozen. With --quantize nf4 the frozen Linear weights of the
blocks become torchao NF4 tensors (`toolkit.parallel.nf4`), sharded by FSDP2 on several devices,
each rank quantizing only its own rows. With --quantize bnb.* they are replaced by bitsandbytes
4-bit or 8-bit layers on the CPU, one weight read and quantized at a time; on more than one device
every rank then quantizes the whole base and only the adapters are synchronised
(`toolkit.parallel.plan.plan_quantized_base` says why).

A finished run writes `<out_dir>/final/`:
    lora_adapter.safetensors, lora.json   the adapter in toolkit names, and what it applies to
    adapter_config.json, adapter_model.safetensors
                                          the same adapter in peft's format with Hugging Face
                                          module names: `PeftModel.from_pretrained(hf_model, dir)`
                                          on the `convert_to_hf` export of the base model
    model_config.json, tokenizer files    so the folder describes itself
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Union

from toolkit.data.instruct import InstructData
from toolkit.training.objectives import Objective
from toolkit.training.preference_objectives import PreferenceObjective  # noqa: F401  (its losses are --objective choices)
from toolkit.errors import UserError, did_you_mean
from toolkit.process import leave_out
from toolkit.finetune.common import FINETUNE_EVAL, run_finetune
from toolkit.models.adapters import LoRAArgs
from toolkit.models.param_names import unwrapped_name, without_wrappers
from toolkit.args import QUANTIZE_CHOICES, DistributedArgs, EvalArgs, LogArgs, QuantizeName, TrainArgs

LORA_TRAIN = TrainArgs(
    global_batch_size=16, micro_batch_size=1, learning_rate=3e-4, min_lr=0.0, warmup_steps=10,
    save_interval=100, weight_decay=0.0,
)

ADAPTER_FILE = "lora_adapter.safetensors"
LORA_META = "lora.json"



def is_adapter_weight(name: str) -> bool:
    return "lora_" in name


def adapter_key(name: str, names: Optional[dict[str, str]] = None) -> str:
    """Toolkit name of an adapter weight: no wrapper prefixes, no adapter name; with `names`
    (`adapter_module_names` of the model) an adapter on a parameter is named after the parameter:
    `blocks.0.mlp.experts.gate_up_proj.lora_A.weight`."""
    if names is None:
        return unwrapped_name(name).replace(".default.", ".")
    module, _, rest = without_wrappers(name).partition(".lora_")
    return f"{names[module]}.lora_{rest}".replace(".default.", ".")


def init_adapters(model, seed: int) -> None:
    """(Re)initialise every LoRA adapter with peft's own rule, from `seed`, on the CPU.

    peft creates adapters on the device of the layer they wrap, which is the meta device when the
    model is built for sharding. Initialising them here, in module order from one seed, gives the
    same adapters on one device and on any number of devices.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    module.lora_A[adapter].to_empty(device="cpu")
                    module.lora_B[adapter].to_empty(device="cpu")
                    module.reset_lora_parameters(adapter, True)


def quantize_linears(model, mode: str, precision: str, read_rows=None):
    """Replace every Linear inside the blocks by a bitsandbytes layer holding the same weights.

    Quantization happens here, on the CPU, before the model is moved (it is never sharded). The output
    head and embeddings stay in full precision (they are small next to the blocks and quantizing
    them costs quality). The 4-bit layers compute in the compute dtype of the resolved Fabric
    `precision` (`precision_dtypes`): float16 under 16-mixed (GPUs without native bfloat16, where
    bfloat16 is emulated and slow), bfloat16 under bf16-*, float32 under 32-true.

    A Linear still on the meta device (finetune_lora prepares the meta model) reads its weight and
    bias through `read_rows` (`toolkit.training.model_setup.ReadRows`), in the checkpoint's dtype,
    and lets them go once quantized, before the next Linear is read: a process never holds more
    than one 16-bit weight of the blocks, on one device as on each of N (where every rank holds the
    whole quantized base).
    """
    import bitsandbytes as bnb
    import torch.nn as nn

    from toolkit.parallel.precision import precision_dtypes
    from toolkit.training.model_setup import release_freed_host_memory

    compute_dtype = precision_dtypes(precision)[1]

    def value(param, name: str):
        return read_rows(unwrapped_name(name), 0, None) if param.is_meta else param.data

    for parent_name, parent in list(model.blocks.named_modules(prefix="blocks")):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            prefix = f"{parent_name}.{child_name}"
            bias = None if child.bias is None else value(child.bias, f"{prefix}.bias").clone()
            weight = value(child.weight, f"{prefix}.weight").contiguous()
            if mode == "bnb.int8":
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias is not None,
                                            has_fp16_weights=False, device="cpu")
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            else:
                quant_type = mode.split(".")[1].removesuffix("-dq")
                double = mode.endswith("-dq")
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias is not None,
                                          compute_dtype=compute_dtype, compress_statistics=double, quant_type=quant_type,
                                          device="cpu")
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=double,
                                                 quant_type=quant_type)
                # bitsandbytes 0.50 on CPUs with AVX-512 BF16: the first forward pass in eval mode
                # without gradients (validation) repacks the weights for an inference-only kernel,
                # after which the layer passes no gradient to its input. Training needs it.
                layer.support_avx512bf16_for_cpu = False
            if bias is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
            del weight, bias
            setattr(parent, child_name, layer.to("cpu"))  # .to() quantizes
            if child.weight.is_meta:
                release_freed_host_memory()
    return model


def current_device():
    """The device this rank trains on (Fabric has set the current CUDA device by the time models are built)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def finetune_lora(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/lora"),
    data: Optional[InstructData] = None,
    objective: Optional[Objective] = None,
    lora: LoRAArgs = LoRAArgs(),
    quantize: Optional[QuantizeName] = None,
    train: TrainArgs = LORA_TRAIN,
    eval: EvalArgs = FINETUNE_EVAL,
    log: LogArgs = LogArgs(),
    distributed: DistributedArgs = DistributedArgs(),
    devices: Union[int, str] = 1,
    num_nodes: int = 1,
    precision: Optional[str] = None,
    seed: int = 1337,
    resume: Union[bool, str, Path] = False,
):
    """Fine-tune low-rank adapters (LoRA, with peft) on a frozen model; QLoRA with --quantize.

    Args:
        checkpoint_dir: A toolkit checkpoint (from `toolkit convert_from_hf`, `download` or pretraining).
        out_dir: Where logs, training checkpoints and the adapter (`<out_dir>/final`) go.
        data: Instruction data: `Alpaca`, `JSON` (records with configurable field names), or `Chat`
            (multi-turn conversations in the model's chat template).
        objective: What to minimise: sft (the default: the response tokens' cross-entropy) on
            instruction data; on preference pairs (--data Preference or HFPreference) dpo or ipo
            (against a reference model: the base with the adapters switched off; or --objective.precompute_reference true), or the
            reference-free simpo and orpo. Their options: --objective.beta and so on (see
            tutorials/preference.md).
        lora: Adapter rank, alpha, dropout and targets.
        quantize: Store the frozen base in 4 bits (QLoRA): nf4 (torchao's NF4, sharded by FSDP2 on
            several devices), or with bitsandbytes, replicated on every device: bnb.nf4, bnb.fp4
            (-dq also quantizes the scales) or bnb.int8.
        train: Optimisation and stopping (default: one epoch).
        eval: Validation cadence.
        log: Logging cadence and destinations.
        distributed: Sharding options, used when devices x num_nodes > 1.
        devices: Devices per node ("auto" for all).
        num_nodes: Number of nodes.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true; default: the best the device supports.
        seed: Random seed for data order and adapter initialisation.
        resume: false; "auto", true, or a training checkpoint path (see `toolkit pretrain --help`).
    """
    from toolkit.training.trackers import run_config

    hparams = run_config(finetune_lora, locals())
    if data is None:
        raise UserError("No training data given: pass --data Alpaca --data.json_path <file.json> (or --data JSON ...).")
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise UserError(f"Unknown --quantize {quantize!r}.{did_you_mean(quantize, QUANTIZE_CHOICES)}")
    leave_out(*unused_quantization_libraries(quantize))

    def check_args(config, run_plan, meta_model) -> None:
        if quantize is not None and "head" in lora.targets:
            raise UserError("--lora.targets head cannot be combined with --quantize: the output head is not quantized; drop 'head'.")
        if lora.parameter_names() and not config.is_moe:
            raise UserError(f"--lora.targets experts: {config.name} has no mixture of experts; drop 'experts'.")
        if config.is_moe and quantize is not None and quantize != "nf4":
            raise UserError(
                f"--quantize {quantize} quantizes Linear layers only and would leave the experts of {config.name} "
                "(most of its weights) in 16 bits: use --quantize nf4."
            )
        _note_rank_above_width(meta_model, lora)
        if quantize == "nf4":
            from toolkit.parallel.nf4 import check_nf4_shardable

            check_nf4_shardable(meta_model, run_plan.shard_size)  # shapes only, before any process is launched

    def prepare(model, run_plan):
        from peft import get_peft_model

        from toolkit.parallel.precision import precision_dtypes

        # The 4-bit layers compute in the run's compute dtype.
        compute_dtype = precision_dtypes(run_plan.precision)[1]
        if quantize == "nf4":
            from toolkit.parallel.nf4 import quantize_blocks_nf4

            # The model is still on the meta device (prepare_on_meta below): each weight is quantized
            # as it is read, its own rows on each rank under FSDP, whole on one device.
            quantize_blocks_nf4(model, compute_dtype, run_plan.strategy.shard_device(current_device()))
        elif quantize is not None:
            from toolkit.model_dir import checkpoint_row_reader

            # The model is on the meta device too: each block weight is read and quantized in turn.
            model = quantize_linears(model, quantize, run_plan.precision, checkpoint_row_reader(Path(checkpoint_dir)))
        # peft freezes every weight that is not an adapter.
        model = get_peft_model(model, lora.peft_config())
        init_adapters(model, seed)
        return model

    def export(session, model) -> None:
        if quantize == "nf4":
            report_nf4_bytes(session.fabric, model)
        save_adapter(session, model, lora, Path(checkpoint_dir), quantize)

    _, model = run_finetune(
        "finetune_lora", checkpoint_dir, out_dir, data, train, eval, log, distributed, devices, num_nodes,
        precision, seed, resume, prepare_model=prepare, frozen_base=True, export=export,
        # Quantization reads the meta model's weights one at a time, quantizing each before the next:
        # no process holds the 16-bit base (bnb.*: every rank holds the whole quantized base).
        prepare_on_meta=quantize is not None,
        check_args=check_args, hparams=hparams, lora=lora, quantize=quantize, objective=objective,
    )
    return model


def _note_rank_above_width(meta_model, lora: LoRAArgs) -> None:
    """Say when --lora.r exceeds the narrower side of an adapted weight: an update B @ A of such a
    weight has rank at most that side, so the rest of the rank adds parameters and work, not
    capacity (the run goes on: a user may want one rank for every layer)."""
    modules = set(lora.module_names())
    parameters = {name.rsplit(".", 1)[1] for name in lora.parameter_names()}
    narrowest = {}
    for path, module in meta_model.named_modules():
        kind = path.rsplit(".", 1)[-1]
        if kind in modules and hasattr(module, "weight"):
            narrowest[kind] = min(narrowest.get(kind, module.weight.shape[0]), *module.weight.shape[-2:])
    for path, param in meta_model.named_parameters():
        kind = path.rsplit(".", 1)[-1]
        if kind in parameters and path.rsplit(".", 2)[-2] == "experts":
            narrowest[kind] = min(narrowest.get(kind, param.shape[-1]), *param.shape[-2:])
    above = {kind: width for kind, width in sorted(narrowest.items()) if width < lora.r}
    if above:
        from toolkit.training.session import print_before_launch

        widths = ", ".join(f"{kind} {width}" for kind, width in above.items())
        print_before_launch(
            f"Note: --lora.r {lora.r} is above the narrower side of some adapted weights ({widths}): their "
            "updates cannot use more rank than that side, and the rest of the rank only adds parameters."
        )


def unused_quantization_libraries(quantize: Optional[str]) -> list[str]:
    """The quantization libraries a run with `quantize` does not use (peft imports both if installed)."""
    uses = {"bitsandbytes": quantize is not None and quantize.startswith("bnb."), "torchao": quantize == "nf4"}
    return [name for name, used in uses.items() if not used]


def report_nf4_bytes(fabric, model) -> list[int]:
    """Print (rank 0) and return the bytes of NF4 base weights each rank holds (collective call)."""
    from toolkit.parallel.nf4 import is_nf4, nf4_storage_bytes
    from toolkit.training.checkpoint_io import gather_objects

    mine = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if is_nf4(local):
            mine += nf4_storage_bytes(local)
    per_rank = gather_objects(fabric, mine)
    fabric.print("NF4 base bytes per rank: " + ", ".join(str(b) for b in per_rank))
    return per_rank


def save_adapter(session, model, lora: LoRAArgs, base_checkpoint: Path, quantize: Optional[str]) -> Path:
    """Write the adapter in toolkit and peft formats to `<out_dir>/final` (collective call)."""
    from toolkit.model_dir import atomic_directory, save_checkpoint_files
    from toolkit.models.adapters import adapter_module_names
    from toolkit.safetensors_io import save_file
    from toolkit.training.checkpoint_io import full_state_dict
    from toolkit.training.failures import run_on_rank_zero

    fabric = session.fabric
    # Only the adapters are gathered on rank 0 (under FSDP they are sharded with the frozen base,
    # which is never gathered).
    names = adapter_module_names(model)
    adapters = {adapter_key(k, names): v for k, v in full_state_dict(fabric, model, keep=is_adapter_weight).items()}
    target = session.out_dir / "final"

    def write() -> None:
        with atomic_directory(target, overwrite=True) as tmp:
            save_file(adapters, tmp / ADAPTER_FILE)
            meta = {"base_checkpoint": str(Path(base_checkpoint).resolve()), "lora": asdict(lora), "quantize": quantize,
                    "base_fingerprint": (session.frozen_base or {}).get("fingerprint")}
            (tmp / LORA_META).write_text(json.dumps(meta, indent=2) + "\n")
            save_checkpoint_files(tmp, {}, session.config, session.tokenizer_dir, weights=False)
            skipped = write_peft_adapter(tmp, adapters, lora, session.config)
        if skipped:
            fabric.print(f"Note: {skipped}.")
        fabric.print(f"Saved the LoRA adapter ({sum(v.numel() for v in adapters.values()):,} parameters) to {target}")

    run_on_rank_zero(fabric, write)
    return target


def write_peft_adapter(directory: Path, adapters: dict, lora: LoRAArgs, config) -> Optional[str]:
    """peft's own adapter format, with the module names of the Hugging Face export of the base.

    An adapter on the experts' weights (`blocks.0.mlp.experts.gate_up_proj.lora_A.weight`) is
    written as peft's LoRA on that parameter of transformers' model (`target_parameters`), which
    holds all experts in one tensor too (`hf_whole_expert_tensor`): peft's factors (A (r * X, in),
    B (out, r * X)) mean the same in either model, its own or transposed (peft reads a transposed
    layout from the module's `is_transposed`); only rows of the weight that transformers orders
    otherwise (gpt-oss's gate and up rows, alternating) are reordered, in B.

    Returns why it could not be written (an adapter on a projection that Hugging Face fuses, or on
    experts it keeps in no single tensor), or None.
    """
    import dataclasses

    from toolkit.convert.weight_maps import expert_rows_to_hf, hf_whole_expert_tensor, toolkit_to_hf_name
    from toolkit.models.adapters import PARAMETER_TARGETS, peft_parameter_paths
    from toolkit.safetensors_io import save_file

    # the experts' parameters in the order their module registers them (peft's order of wrapping)
    parameter_order = [p.rsplit(".", 1)[-1] for names in PARAMETER_TARGETS.values() for p in names]

    def registration_order(name: str) -> int:
        return parameter_order.index(name.rsplit(".", 1)[-1])

    hf_weights, hf_modules, hf_parameters, fused = {}, set(), set(), []
    on_parameters: dict[str, dict[str, dict[str, object]]] = {}  # HF module -> parameter -> {lora part: tensor}
    for name, tensor in adapters.items():
        module, lora_part = name.split(".lora_")  # blocks.0.attn.q_proj, A.weight
        if any(module.endswith("." + p) for names in PARAMETER_TARGETS.values() for p in names):
            found = hf_whole_expert_tensor(config.family, module)
            if found is None:
                return (f"{config.family} keeps {module} in no single Hugging Face tensor, so this adapter has no "
                        "peft-format copy; use `toolkit merge_lora` and export the merged model")
            hf_param, part = found  # model.layers.0.mlp.experts.gate_up_proj
            if part is not None and part.interleaved and lora_part.startswith("B"):
                tensor = expert_rows_to_hf(dataclasses.replace(part, transposed=False), tensor)  # B's rows are the weight's
            hf_module, _, parameter = hf_param.rpartition(".")
            hf_parameters.add(hf_module.rsplit(".", 1)[-1] + "." + parameter)  # experts.gate_up_proj
            on_parameters.setdefault(hf_module, {}).setdefault(parameter, {})[lora_part] = tensor
            continue
        hf_name, index, parts = toolkit_to_hf_name(config.family, module + ".weight")
        if parts > 1:
            short = module.rsplit(".", 1)[-1]
            fused += [short] if short not in fused else []
            continue
        hf_module = hf_name.removesuffix(".weight")
        hf_modules.add(hf_module.rsplit(".", 1)[-1])
        hf_weights[f"base_model.model.{hf_module}.lora_{lora_part}"] = tensor.contiguous()
    if fused:
        return (f"{config.family} stores {', '.join(fused)} fused with other projections in Hugging Face format, so "
                "this adapter has no peft-format copy; use `toolkit merge_lora` and export the merged model")
    for hf_module, parameters in on_parameters.items():
        paths = peft_parameter_paths(hf_module, sorted(parameters, key=registration_order))
        for parameter, tensors in parameters.items():
            for lora_part, tensor in tensors.items():
                hf_weights[f"base_model.model.{paths[parameter]}.lora_{lora_part}"] = tensor.contiguous()
    save_file(hf_weights, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_config = lora.peft_config(sorted(hf_modules), sorted(hf_parameters, key=registration_order)).to_dict()
    peft_config["base_model_name_or_path"] = config.hf_repo_id or None
    peft_config["task_type"] = "CAUSAL_LM"
    for key, value in list(peft_config.items()):
        if isinstance(value, set):
            peft_config[key] = sorted(value)
    (directory / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, default=str) + "\n")
    return None


def find_adapter_dir(path: Path | str) -> Optional[Path]:
    """`path` or its `final` folder, whichever holds a LoRA adapter (lora.json); None if neither does."""
    path = Path(path)
    for candidate in (path, path / "final"):
        if (candidate / LORA_META).is_file():
            return candidate
    return None


def read_adapter_meta(adapter_dir: Path) -> tuple[Path, LoRAArgs]:
    """(the base checkpoint, the adapter's settings), as `save_adapter` recorded them. A base whose
    weights are no longer those the adapter was trained on (its fingerprint, where recorded) is refused."""
    from toolkit.model_dir import checkpoint_fingerprint, require_checkpoint_dir

    meta = json.loads((Path(adapter_dir) / LORA_META).read_text())
    base = Path(meta["base_checkpoint"])
    recorded = meta.get("base_fingerprint")
    if recorded is not None:
        require_checkpoint_dir(base)
        found = checkpoint_fingerprint(base)
        if found != recorded:
            raise UserError(
                f"The adapter in {adapter_dir} was trained on {base} with other weights (fingerprint {recorded}, now "
                f"{found}): the base was replaced since. Restore it (or an exact copy at that path) to apply the adapter."
            )
    return base, LoRAArgs(**{**meta["lora"], "targets": tuple(meta["lora"]["targets"])})


def attach_adapter(model, adapter_dir: Path, lora: LoRAArgs):
    """`model` wrapped by peft with the saved adapter loaded into it, not merged."""
    from peft import get_peft_model, set_peft_model_state_dict

    from toolkit.safetensors_io import load_file

    from toolkit.models.adapters import adapter_module_names

    peft_model = get_peft_model(model, lora.peft_config())
    adapters = load_file(Path(adapter_dir) / ADAPTER_FILE)
    paths = {toolkit: path for path, toolkit in adapter_module_names(peft_model).items()}
    state = {}
    for key, value in adapters.items():
        module, _, part = key.partition(".lora_")
        state[f"base_model.model.{paths.get(module, module)}.lora_{part}"] = value
    result = set_peft_model_state_dict(peft_model, state)
    if result.unexpected_keys:
        raise UserError(f"The adapter in {adapter_dir} does not fit its base model: {result.unexpected_keys[0]} has no place in it.")
    return peft_model


def merge_lora(adapter_dir: Path, out_dir: Optional[Path] = None, overwrite: bool = False) -> Path:
    """Merge a LoRA adapter into its base model and write a full toolkit checkpoint.

    Args:
        adapter_dir: The LoRA run's folder or its `final` folder (holds lora.json).
        out_dir: Where the merged checkpoint goes; default `<run folder>/merged`.
        overwrite: Replace an existing checkpoint in out_dir.
    """
    import torch

    from toolkit.model_dir import atomic_directory, load_model, save_checkpoint_files

    found = find_adapter_dir(adapter_dir)
    if found is None:
        raise UserError(f"{adapter_dir} holds no LoRA adapter ({LORA_META}); pass the out_dir of a finetune_lora run.")
    adapter_dir = found
    base, lora = read_adapter_meta(adapter_dir)
    out_dir = Path(out_dir) if out_dir is not None else adapter_dir.parent / "merged"
    model = load_model(base)
    if model.config.tie_embeddings and "lm_head" in lora.module_names():
        # The head shares its matrix with the input embeddings; merging its update in place would
        # change the embeddings too. Give the head its own copy: the merged model is untied.
        model.lm_head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
        model.config = dataclasses.replace(model.config, tie_embeddings=False)
        print("Note: the adapter updates the output head, which shares its weights with the embeddings; "
              "the merged model has a separate head (tie_embeddings false).")
    peft_model = attach_adapter(model, adapter_dir, lora)
    with torch.no_grad():
        merged = peft_model.merge_and_unload()
    with atomic_directory(out_dir, overwrite=overwrite, inputs=(adapter_dir, base)) as tmp:
        save_checkpoint_files(tmp, merged.state_dict(), merged.config, adapter_dir)
    print(f"Merged {adapter_dir} into {base}: {out_dir}")
    return out_dir
