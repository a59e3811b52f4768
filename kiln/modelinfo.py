"""What an installed model is, read from its GGUF file and its store record: what `kiln show` prints
and Ollama's /api/show returns."""

from __future__ import annotations

from collections import Counter


def describe(record) -> dict:
    """Everything `kiln show` reports, read from the GGUF file."""
    from kiln.errors import UnsupportedModelError
    from kiln.gguf import REQUANTIZED_TYPES, GGUFFile, as_int
    from kiln.models import family_for
    from kiln.models.base import active_parameters
    from kiln.engine.fim import file_tokens
    from kiln.store import quantization_name
    from kiln.store.fetch import sha256_file

    gguf = GGUFFile(record.path)
    try:
        config = None
        try:
            config = family_for(gguf).config  # a file kiln runs is shown only once it passes the checks a load makes
        except UnsupportedModelError:
            pass  # an architecture kiln does not run: what is shown is read defensively below
        arch = gguf.architecture
        meta = lambda key, default=None: gguf.get(f"{arch}.{key}", default)  # noqa: E731
        layers = as_int(meta("block_count"))
        heads = _heads(meta("attention.head_count"))
        kv_heads = _heads(meta("attention.head_count_kv")) or heads
        embedding = as_int(meta("embedding_length")) or None
        widest = max(heads) if isinstance(heads, list) and heads else heads
        head_dim = as_int(meta("attention.key_length")) or (embedding // widest if embedding and widest else None)
        context = as_int(meta("context_length"))
        memory = _footprint(record)
        n_params = sum(t.n_elements for t in gguf.tensors.values())
        template = gguf.get("tokenizer.chat_template")
        return {
            "tag": record.tag,
            "path": str(record.path),
            "sha256": record.sha256 or sha256_file(record.path),
            "size": record.path.stat().st_size,
            "family": arch,
            "name": gguf.get("general.name"),
            "parameters": n_params,
            "active_parameters": active_parameters(gguf, config) if config is not None else n_params,
            "quantization": quantization_name(gguf),
            "tensor_types": dict(Counter(t.type.name for t in gguf.tensors.values()).most_common()),
            "requantized": sorted({t.type.name for t in gguf.tensors.values() if t.type in REQUANTIZED_TYPES}),
            "context_length": context,
            "embedding_length": embedding,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            **memory,
            "labels": record.details.get("labels", []),
            "chat_template": template,
            "insert": file_tokens(gguf) is not None,  # it has fill-in-the-middle tokens
            "system": record.system,
            "defaults": record.effective_parameters(),
            "license": record.license,
            "source": record.source,
        }
    finally:
        gguf.close()


def _footprint(record) -> dict:
    """What loading the model allocates (packed weights, the KV cache at the default context in the type
    KILN_KV_CACHE_TYPE names, else fp16, working buffers), or the file's bytes when the native core cannot say."""
    from kiln.errors import KilnError
    from kiln.validate import footprint

    try:
        fp = footprint(str(record.path), None)
    except (KilnError, ImportError) as e:
        return {"weights_bytes": record.path.stat().st_size, "kv_cache_bytes": None, "kv_context": None,
                "kv_cache_type": None,
                "working_bytes": None, "footprint_bytes": None, "footprint_note": str(e)}
    return {"weights_bytes": fp["weights_bytes"], "kv_cache_bytes": fp["kv_bytes"], "kv_context": fp["n_ctx"],
            "kv_cache_type": fp["kv_type"],
            "working_bytes": fp["working_bytes_estimate"], "footprint_bytes": fp["total_bytes"]}


def _heads(value):
    """A head count: a number, or (in some architectures) one number per layer, shown as one number when
    every layer has the same; None when the file has none."""
    from kiln.gguf import as_int

    if value is None:
        return None
    if not hasattr(value, "__len__") or isinstance(value, str):
        return as_int(value) or None
    values = [as_int(v) for v in value]
    return values[0] if values and len(set(values)) == 1 else values or None


def modelfile_of(record) -> str:
    from kiln.modelfile import render

    return render(record.tag if record.sha256 else str(record.path), record.system, record.effective_parameters(),
                  record.license)
