"""Hugging Face Llama and Mixtral checkpoints in and out: ``from_hf`` (a Hugging Face
directory -> a jaxdist weights checkpoint) and ``to_hf`` (a checkpoint -> a Hugging Face
directory), the work of ``python -m jaxdist.convert``. ``config.json``'s ``model_type``
picks the mapping on the way in (``jaxdist.hf.llama`` or ``jaxdist.hf.mixtral``), the
model's ``moe_experts`` on the way out.

``from_hf`` reads ``config.json`` and the ``*.safetensors`` shards (through their index)
one tensor at a time and writes each parameter straight into its shards (FSDP over the
local devices), in the source dtype: converting needs about one layer-stacked tensor of
host memory beyond the output. The tokenizer and the source config are kept in
``OUT/hf_source`` (the config points ``data.tokenizer`` there, relative to OUT, so the
folder can move), so ``to_hf`` of a run fine-tuned from OUT writes them back. Nothing is
downloaded. Every file is resolved inside HF_DIR (``jaxdist.hf.files``); the config's
sizes are checked against the tensors the safetensors headers list, each tensor's shape
against the config, before anything is built; OUT is created after every check, and a
failure while writing removes what was written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from jaxdist.config import Config
from jaxdist.data.chat_template import CONFIG_FILE, TEMPLATE_FILE, ChatTemplate, find_chat_template
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.hf import llama, mixtral
from jaxdist.hf.files import SOURCE_DIR, TOKENIZER_FILES, inside, optional_file, read_json, source_dir
from jaxdist.layout.mesh import build_mesh, parse_mesh
from jaxdist.layout.sharding import rules_for, tree_shardings
from jaxdist.layout.strategy import resolve_strategy
from jaxdist.models.counts import count_params
from jaxdist.models.llama import Llama
from jaxdist.training.weights import checkpoint_config, find_checkpoint, param_tree_key, read_arrays, save_weights, state_tree

INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 2**30
WEIGHT_DTYPES = ("F32", "BF16", "F16")  # safetensors' names of the dtypes a Llama's weights come in

log = logging.getLogger(__name__)


def mapping_for_hf(hf: dict):
    """The module that maps a Hugging Face ``config.json`` of this ``model_type``
    (anything but mixtral goes to the Llama mapping, which names what converts)."""
    return mixtral if hf.get("model_type") == "mixtral" else llama


def mapping_for_model(model):
    """The module that writes a jaxdist model as Hugging Face: Mixtral for an MoE decoder."""
    return mixtral if model.moe_experts > 0 else llama


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


# ---------------------------------------------------------------------------------------------
# from-hf


class SafetensorsReader:
    """The tensors of a Hugging Face directory (one file, or shards listed by the index),
    every file resolved inside the directory; their headers (names, shapes, dtypes) are
    read up front, the tensors one at a time with a progress bar."""

    def __init__(self, hf_dir: Path, progress: bool = True):
        self.hf_dir = hf_dir
        self.files = self._locate(hf_dir)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._read_headers()
        self.progress, self.bar = progress, None

    @staticmethod
    def _locate(hf_dir: Path) -> dict[str, Path | None]:
        """Tensor name -> its file, resolved inside ``hf_dir`` (None: from the single file's header)."""
        index = optional_file(hf_dir, INDEX)
        if index is not None:
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise JaxdistError(f"{index}: no weight_map of tensor names to file names")
            resolved = {file: inside(hf_dir, file) for file in sorted(set(weight_map.values()))}  # an entry out of HF_DIR fails here
            missing_files = sorted(file for file, path in resolved.items() if not path.is_file())
            if missing_files:
                raise JaxdistError(f"{hf_dir}: missing shard(s) {', '.join(missing_files[:3])} listed in {INDEX}")
            return {name: resolved[file] for name, file in weight_map.items()}
        single = sorted(hf_dir.glob("*.safetensors"))
        if not single:
            raise JaxdistError(f"{hf_dir}: no *.safetensors files (and no {INDEX})")
        if len(single) > 1:
            raise JaxdistError(f"{hf_dir}: {len(single)} safetensors files but no {INDEX} to say which tensor is where")
        return {"": optional_file(hf_dir, single[0].name)}  # names come from its header

    def _read_headers(self) -> None:
        by_file: dict[Path, list[str]] = {}
        for name, path in self.files.items():
            by_file.setdefault(path, []).append(name)
        located: dict[str, Path] = {}
        for path, names in by_file.items():
            try:
                with safe_open(path, framework="numpy") as f:
                    keys = set(f.keys())
                    listed = sorted(keys) if names == [""] else names
                    for name in listed:
                        if name not in keys:
                            raise JaxdistError(f"{path}: has no tensor {name} ({INDEX} says it does)")
                        view = f.get_slice(name)
                        self.shapes[name], self.dtypes[name] = tuple(view.get_shape()), view.get_dtype()
                        located[name] = path
            except JaxdistError:
                raise
            except Exception as e:  # noqa: BLE001 - a truncated or garbage header is one line
                raise JaxdistError(f"{path}: unreadable safetensors file ({_first_line(e)})") from None
        self.files = located

    def check_dtypes(self, names: list[str]) -> None:
        for name in names:
            if self.dtypes[name] not in WEIGHT_DTYPES:
                raise JaxdistError(f"{self.files[name]}: tensor {name} is {self.dtypes[name]}; weights are F32, BF16 or F16")

    def __call__(self, name: str):
        if self.bar is None:
            self.bar = tqdm(total=len(self.shapes), desc="from-hf", unit="tensor", disable=not self.progress, file=sys.stderr)
        path = self.files[name]
        try:  # opened per tensor: an open file's memory-mapped pages would stay resident
            with safe_open(path, framework="numpy") as f:
                tensor = f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a corrupt shard is one line
            raise JaxdistError(f"{path}: unreadable safetensors file ({_first_line(e)})") from None
        if tuple(tensor.shape) != self.shapes[name]:  # checked against the config before; the file changed since
            raise JaxdistError(f"{path}: tensor {name} is {tuple(tensor.shape)}, its header said {self.shapes[name]}")
        self.bar.update(1)
        return tensor

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _source_tokenizer(hf_dir: Path) -> str | None:
    """The tokenizer file to keep (checked to load), or None when the directory has none."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if optional_file(hf_dir, name) is not None:  # checked inside HF_DIR; loaded by its name (a hub cache's blobs have no suffix)
            load_tokenizer(hf_dir / name)  # an unreadable or unknown tokenizer fails here, before OUT exists
            return name
    config = optional_file(hf_dir, "tokenizer_config.json")
    if config is not None:
        kind = read_json(config).get("tokenizer_class", "?")
        raise JaxdistError(f"{hf_dir}: tokenizer {kind} has no tokenizer.json or tokenizer.model that jaxdist can read")
    return None


def _to_device(source, want, sharding, name: str, in_place: bool | None = None):
    """One parameter on the devices, in ``sharding``. On GPUs a layer stack is filled in
    place one layer at a time (a donated update): the host holds one layer, not the stack."""
    if not isinstance(source, llama.Stacked):
        if source.shape != want.shape:
            raise JaxdistError(f"{name} is {source.shape}, the config says {want.shape}")
        return jax.make_array_from_callback(source.shape, sharding, lambda index: np.asarray(source[index]))
    first = source.layer(0)
    if (source.layers, *first.shape) != tuple(want.shape):
        raise JaxdistError(f"{name} stacks to {(source.layers, *first.shape)}, the config says {want.shape}")
    if in_place is None:
        in_place = any(device.platform != "cpu" for device in sharding.device_set)
    if not in_place:
        # CPU "devices" are host memory, and XLA:CPU copies the whole stack on each update:
        # one host stack, copied once, costs less there.
        stack = np.empty(want.shape, first.dtype)
        for i in range(source.layers):
            stack[i] = first if i == 0 else _same_shape(source.layer(i), first, name, i)
        return jax.make_array_from_callback(stack.shape, sharding, lambda index: stack[index])
    stack = jax.jit(lambda: jnp.zeros(want.shape, first.dtype), out_shardings=sharding)()
    put = jax.jit(lambda stack, layer, i: stack.at[i].set(layer), donate_argnums=0, out_shardings=sharding)
    for i in range(source.layers):
        stack = put(stack, first if i == 0 else _same_shape(source.layer(i), first, name, i), i)
    return stack


def _same_shape(layer, first, name: str, i: int):
    """Layer ``i`` of a stack, refused unless shaped as layer 0 (assignment would broadcast it)."""
    if layer.shape != first.shape:
        raise JaxdistError(f"{name}: layer {i} is {layer.shape}, layer 0 is {first.shape}")
    return layer


def from_hf(hf_dir: Path, out: Path, *, progress: bool = True) -> Path:
    """Convert; returns the step directory written."""
    if not hf_dir.is_dir():
        raise JaxdistError(f"{hf_dir}: not a directory")
    if out.exists() and any(out.iterdir()):
        raise JaxdistError(f"{out} already exists and is not empty; choose a new output directory")
    # Every check reads only config.json and the safetensors headers: nothing is built or written before they pass.
    config_file = optional_file(hf_dir, "config.json")
    if config_file is None:
        raise JaxdistError(f"{hf_dir / 'config.json'}: no such file")
    hf = read_json(config_file)
    mapping = mapping_for_hf(hf)
    model = mapping.model_config_from_hf(hf, str(hf_dir / "config.json"))
    kept = {name: path for name in (*TOKENIZER_FILES, "config.json") if (path := optional_file(hf_dir, name)) is not None}
    tokenizer = _source_tokenizer(hf_dir)
    reader = SafetensorsReader(hf_dir, progress)
    mapping.check_tensors(model, reader.shapes, str(hf_dir), str(hf_dir / "config.json"))
    reader.check_dtypes(list(reader.shapes))
    for note in mixtral.training_notes(hf) if mapping is mixtral else []:
        log.info(f"{hf_dir / 'config.json'}: {note}")

    config = Config(name=re.sub(r"[^A-Za-z0-9._-]+", "-", hf_dir.name).strip(".-") or "hf")  # a name must be one path component
    config.model = model
    if tokenizer:
        config.data.tokenizer = f"{SOURCE_DIR}/{tokenizer}"  # relative to OUT: the converted folder can move
    else:  # no tokenizer: token ids in and out, which is what data.source=tokens says
        config.data.source = "tokens"
        log.info(f"{hf_dir} has no tokenizer: the converted model takes token ids (generate --prompt-ids, data.source=tokens)")
    devices = jax.devices()
    sizes = parse_mesh(f"fsdp={len(devices)}")
    mesh = build_mesh(sizes, devices)
    abstract = nnx.split(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))))[1]
    shardings = dict(nnx.to_flat_state(tree_shardings(abstract, rules_for(resolve_strategy("fsdp", sizes)), mesh)))
    flat = dict(nnx.to_flat_state(abstract))
    created = not out.exists()
    try:
        filled = set()
        for path, source in mapping.from_hf(model, reader):
            flat[path] = flat[path].replace(_to_device(source, flat[path], shardings[path].get_value(), f"{hf_dir}: {'/'.join(path)}"))
            filled.add(path)
        if filled != set(flat):  # a mapping that missed a parameter would save its abstract shape
            raise JaxdistError(f"{hf_dir}: the mapping leaves {', '.join('/'.join(p) for p in sorted(set(flat) - filled))} unset")
        reader.close()
        out.mkdir(parents=True, exist_ok=True)
        (out / SOURCE_DIR).mkdir()
        for name, path in kept.items():  # the resolved files (checked to be inside HF_DIR), not the links
            shutil.copyfile(path, out / SOURCE_DIR / name)
        step_dir = save_weights(out, nnx.from_flat_state(flat), config)
    except BaseException:
        reader.close()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        elif out.is_dir():  # it was empty: empty it again
            for child in out.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        raise
    if TEMPLATE_FILE in kept or (CONFIG_FILE in kept and read_json(kept[CONFIG_FILE]).get("chat_template")):
        log.info(f"kept the chat template in {out / SOURCE_DIR} (data.source=chat and generate --chat use it)")
    vocab = f"vocab {model.valid_vocab or model.vocab_size}" + (f" (padded to {model.vocab_size})" if model.valid_vocab else "")
    experts = f", {model.moe_experts} experts (top {model.moe_top_k})" if model.moe_experts else ""
    params = f"{count_params(model) / 1e6:.1f}M params{experts}"
    log.info(f"converted {hf_dir} -> {step_dir}: {params}, {vocab}; config {out / 'config.yaml'}")
    return step_dir


# ---------------------------------------------------------------------------------------------
# to-hf


def to_hf(checkpoint: str | Path, out: Path, *, dtype: str = "auto") -> Path:
    """Export the checkpoint's parameters as a Hugging Face Llama directory (Mixtral for an MoE model)."""
    step_dir = find_checkpoint(checkpoint)
    config = checkpoint_config(step_dir)
    if config.model.kind != "llama":
        raise JaxdistError(f"checkpoint {step_dir}: model.kind {config.model.kind!r} is not a Llama")
    mapping = mapping_for_model(config.model)
    if mapping is mixtral:
        mixtral.check_exportable(config.model, f"checkpoint {step_dir}")
    if out.exists() and any(out.iterdir()):
        raise JaxdistError(f"{out} already exists and is not empty; choose a new output directory")
    source = source_dir(config, step_dir)
    kept = {name: path for name in TOKENIZER_FILES if source and (path := optional_file(source, name))}  # nothing from outside it
    source_config_file = optional_file(source, "config.json") if source else None
    source_config = read_json(source_config_file) if source_config_file else {}
    if dtype == "auto":
        dtype = str(source_config.get("torch_dtype") or source_config.get("dtype") or "float32")
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise JaxdistError(f"--dtype {dtype!r}: expected float32, bfloat16 or float16")
    template = trained_chat_template(config)

    metadata = ocp.tree.to_flat_dict(state_tree(step_dir))
    prefix = param_tree_key(step_dir)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])

    def param(path: tuple[str, ...]) -> np.ndarray:  # one stored array, read alone onto the host
        key = (*prefix, *path, "value")
        meta = metadata[key]
        target: dict = jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=device)
        for part in reversed(key):
            target = {part: target}
        restored = read_arrays(step_dir, target)
        for part in key:
            restored = restored[part]
        return np.asarray(restored)

    out.mkdir(parents=True, exist_ok=True)
    try:
        shards, current, size, weight_map = [], {}, 0, {}

        def flush() -> None:
            nonlocal current, size
            if current:
                name = f"part-{len(shards) + 1}.safetensors"
                save_file(current, out / name, metadata={"format": "pt"})
                shards.append((name, list(current)))
                current, size = {}, 0

        for name, tensor in mapping.to_hf(config.model, param):
            tensor = np.ascontiguousarray(tensor.astype(np_dtype))
            if size and size + tensor.nbytes > MAX_SHARD_BYTES:
                flush()
            current[name], size = tensor, size + tensor.nbytes
        flush()
        total_bytes = sum((out / f).stat().st_size for f, _ in shards)
        for i, (old, names) in enumerate(shards, 1):
            new = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            (out / old).rename(out / new)
            weight_map.update(dict.fromkeys(names, new))
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
        extra = {k: v for k, v in source_config.items() if k in mapping.KEPT_FIELDS}
        m = config.model
        longest = max(config.train.seq_len, int(m.rope_original_max_len * m.rope_scaling_factor))  # what the rope scaling was made for
        hf = mapping.hf_config(m, dtype=dtype, max_positions=longest, extra=extra)
        (out / "config.json").write_text(json.dumps(hf, indent=2))
        copied = []
        if source is not None:
            for name, path in kept.items():
                shutil.copyfile(path, out / name)
                copied.append(name)
        elif config.data.tokenizer and Path(config.data.tokenizer).suffix == ".json" and Path(config.data.tokenizer).is_file():
            shutil.copy2(config.data.tokenizer, out / "tokenizer.json")
            copied.append("tokenizer.json")
        if template is not None:
            write_chat_template(out, template.text)
            copied += [] if TEMPLATE_FILE in copied else [TEMPLATE_FILE]
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    tokenizer = f"tokenizer files: {', '.join(copied)}" if copied else "no tokenizer files (the run had none)"
    log.info(f"exported {step_dir} -> {out}: {len(weight_map)} tensors in {len(shards)} file(s), {dtype}; {tokenizer}")
    return out


def trained_chat_template(config: Config) -> ChatTemplate | None:
    """The chat template a run fine-tuned with (``data.source=chat``, or ``data.chat_template``
    given): ``data.chat_template``, else the one beside its tokenizer; None for other runs, whose
    imported tokenizer files carry theirs. One that is gone is said in one line and left out."""
    if config.data.source != "chat" and not config.data.chat_template:
        return None
    try:
        return find_chat_template(config.data.chat_template, config.data.tokenizer)
    except JaxdistError as e:
        log.warning(f"the chat template the run trained with is not exported: {e}")
        return None


def write_chat_template(out: Path, text: str) -> None:
    """``OUT/chat_template.jinja`` (what transformers reads first) and the same template in
    tokenizer_config.json when there is one (what transformers before the .jinja file read)."""
    (out / TEMPLATE_FILE).write_text(text, encoding="utf-8")
    config_file = out / CONFIG_FILE
    if config_file.is_file():
        tokenizer_config = read_json(config_file)
        if tokenizer_config.get("chat_template") != text:
            config_file.write_text(json.dumps({**tokenizer_config, "chat_template": text}, indent=2, ensure_ascii=False), encoding="utf-8")
