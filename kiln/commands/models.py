"""Model management: `kiln pull`, `list`, `rm`, `show`, `check`, `create` and `cp`."""

from __future__ import annotations

import json
import sys

from kiln.modelinfo import describe, modelfile_of

TEMPLATE_PREVIEW_LINES = 8


def register(subparsers) -> None:
    p = subparsers.add_parser("pull", help="download a catalog model, or import a .gguf file into the store")
    p.add_argument("model", metavar="TAG|PATH", help="a catalog tag (see `kiln list`) or a path to a .gguf file")
    p.add_argument("--name", metavar="TAG", help="tag for an imported file (default: derived from the file name)")
    p.add_argument("--force", action="store_true", help="download again, or replace an existing imported tag")
    p.set_defaults(func=cmd_pull)

    p = subparsers.add_parser("list", aliases=["ls"], help="installed and available models")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--filter", choices=["all", "installed", "available"], default="all",
                   help="installed: only installed models; available: catalog models not installed yet")
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("rm", help="remove an installed model and its cached artifacts")
    p.add_argument("model", metavar="TAG")
    p.set_defaults(func=cmd_rm)

    p = subparsers.add_parser("show", help="architecture, size, quantization and memory footprint of a model")
    p.add_argument("model", metavar="TAG|PATH")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--template", action="store_true", help="print the whole chat template")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--modelfile", action="store_true", help="print a Modelfile that recreates the model")
    only.add_argument("--system", action="store_true", help="print the model's system message")
    only.add_argument("--parameters", action="store_true", help="print the model's sampling defaults and stop strings")
    only.add_argument("--license", action="store_true", help="print the model's license")
    p.set_defaults(func=cmd_show)

    p = subparsers.add_parser("create", help="make a model with its own system message and defaults (a Modelfile)",
                              description="Create NAME from a Modelfile: FROM a tag or a .gguf file, SYSTEM, "
                                          "PARAMETER (sampling values, stop), LICENSE. The weights are shared.")
    p.add_argument("model", metavar="NAME")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    p.set_defaults(func=cmd_create)

    p = subparsers.add_parser("cp", help="copy a model to another tag (the weights are shared)")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("destination", metavar="DESTINATION")
    p.set_defaults(func=cmd_cp)

    p = subparsers.add_parser("check", help="re-verify the sha256 of installed models and their repack caches")
    p.add_argument("model", metavar="TAG", nargs="?", help="one model (default: all installed)")
    p.set_defaults(func=cmd_check)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            break
        n /= 1000
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def cmd_pull(args) -> int:
    from kiln.store import Store

    record = Store().pull(args.model, progress=True, name=args.name, force=args.force)
    print(f"{record.tag}: {human_bytes(record.size)}, sha256 {record.sha256}, from {record.source}")
    return 0


def list_rows(store, which: str = "all") -> list[dict]:
    """One dict per model: installed ones (with `problem` when damaged), then catalog models not installed.
    A catalog model's size and sha256 are None until measured (the hub reports them at pull time)."""
    from kiln.machine import mem_available_bytes

    available = mem_available_bytes()
    rows = []
    installed = store.installed()
    installed_tags = {r.tag for r in installed}
    if which in ("all", "installed"):
        for r in installed:
            row = {"tag": r.tag, "installed": True, "size": r.size, "sha256": r.sha256, "source": r.source}
            row = {**row, **r.details, "pulled_at": r.pulled_at, "problem": r.problem}
            rows.append({**row, **_catalog_fields(store, r.catalog), **_fit(_installed_need(r), available)})
    if which in ("all", "available"):
        from kiln.validate import catalog_need

        for e in store.available():
            if e.tag not in installed_tags:
                row = {"tag": e.tag, "installed": False, "size": e.size, "sha256": e.sha256, "source": None}
                row = {**row, **e.details(), "pulled_at": None, "problem": None}
                rows.append({**row, **_catalog_fields(store, e), **_fit(catalog_need(e), available)})
    return rows


def _catalog_fields(store, entry) -> dict:
    return {"aliases": store.aliases_of(entry.tag) if entry else [], "from": entry.origin if entry else None}


def _installed_need(record) -> tuple[int | None, str]:
    """kiln's footprint of the file (packed weights, KV cache at the default context, working buffers), or the
    catalog's estimate from the installed size when the file's footprint cannot be computed."""
    import dataclasses

    from kiln.errors import KilnError
    from kiln.validate import catalog_need, footprint

    if record.problem:
        return None, "damaged"
    try:
        return footprint(record.tag, None)["total_bytes"], "footprint"
    except (KilnError, ImportError) as e:
        if record.catalog:
            return catalog_need(dataclasses.replace(record.catalog, size=record.size))
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__


def _fit(need: tuple[int | None, str], available: int | None) -> dict:
    """Whether `need` bytes fit in this machine's MemAvailable (None: either is unknown)."""
    need_bytes, basis = need
    fits = None if need_bytes is None or available is None else need_bytes <= available
    return {"need_bytes": need_bytes, "need_basis": basis, "fits": fits}


def cmd_list(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from kiln.store import Store

    store = Store()
    store.clean_stale()
    rows = list_rows(store, args.filter)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no models installed" if args.filter == "installed" else "no models")
        return 0
    table = Table(box=None, pad_edge=False)
    table.add_column("")
    table.add_column("TAG", no_wrap=True, min_width=max(len(row["tag"]) for row in rows))
    for column in ("SIZE", "FITS", "FAMILY", "PARAMS", "QUANT", "CONTEXT", "LABELS", "STATUS"):
        table.add_column(column, justify="right" if column in ("SIZE", "CONTEXT") else "left")
    for row in rows:
        mark = "[red]![/]" if row["problem"] else "[green]✓[/]" if row["installed"] else ""
        status = row["problem"] or ("installed" if row["installed"] else "available")
        details = [row.get(key, "?") for key in ("family", "parameters", "quantization", "context_length")]
        labels = ", ".join(row.get("labels", []))
        size = "?" if row["size"] is None else human_bytes(row["size"])
        fits = {True: "yes", False: "no", None: "?"}[row["fits"]]
        # `name` alone is name:latest, Ollama's way
        tag = " = ".join([row["tag"], *(a.removesuffix(":latest") for a in row["aliases"] if a.endswith(":latest"))])
        table.add_row(mark, tag, size, fits, *map(str, details), labels, Text(status))
    Console().print(table)
    return 0


def cmd_rm(args) -> int:
    from kiln.store import Store

    record = Store().remove(args.model)
    print(f"removed {record.tag}")
    return 0


def _runs_as(type_names: list[str]) -> str:
    """What the types without a kernel run as: rewritten exactly into a kernel type, or requantized to Q8_0."""
    from kiln.gguf import EXACT_REWRITES, QT

    rewritten = [(n, EXACT_REWRITES[QT[n]][0].name) for n in type_names if QT[n] in EXACT_REWRITES]
    requantized = [n for n in type_names if QT[n] not in EXACT_REWRITES]
    parts = [f"{target} for its {n} tensors (the same values, rewritten at load)" for n, target in rewritten]
    if requantized:
        parts.append(f"Q8_0 for its {', '.join(requantized)} tensors: kiln has no kernel for them, so they are "
                     "requantized at load")
    return "; ".join(parts)


def _millions_or_billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def cmd_create(args) -> int:
    from pathlib import Path

    from kiln.errors import KilnError
    from kiln.modelfile import parse
    from kiln.store import Store

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except OSError as e:
        raise KilnError(f"cannot read the Modelfile {args.file}: {e.strerror}") from None
    recipe = parse(text, args.file)
    if recipe.ignored:
        print(f"ignored (set by kiln run and kiln serve options instead): {', '.join(recipe.ignored)}", file=sys.stderr)
    record = Store().create(args.model, recipe, progress=True)
    print(f"created {record.tag} from {recipe.base}")
    return 0


def cmd_cp(args) -> int:
    from kiln.store import Store

    record = Store().copy(args.source, args.destination)
    print(f"copied {args.source} to {record.tag}")
    return 0


def cmd_show(args) -> int:
    from kiln.store import Store

    record = Store().resolve(args.model)
    if args.modelfile:
        print(modelfile_of(record), end="")
        return 0
    if args.system or args.license:
        text = record.system if args.system else record.license
        if text:
            print(text)
        return 0
    if args.parameters:
        from kiln.modelfile import parameter_items

        for name, value in parameter_items(record.effective_parameters()):
            print(f"{name:<16} {value}")
        return 0
    info = describe(record)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    types = ", ".join(f"{name} ×{count}" for name, count in info["tensor_types"].items())
    if info["footprint_bytes"] is None:
        footprint = f"unknown ({info['footprint_note']})"
    else:
        footprint = (
            f"{human_bytes(info['footprint_bytes'])} = packed weights {human_bytes(info['weights_bytes'])}"
            f" + KV cache {human_bytes(info['kv_cache_bytes'])} ({info['kv_context']} tokens, {info['kv_cache_type']})"
            f" + working buffers ≤ {human_bytes(info['working_bytes'])}"
        )
    fields = [
        ("model", info["tag"]),
        ("name", info["name"]),
        ("file", info["path"]),
        ("sha256", info["sha256"]),
        ("size", f"{human_bytes(info['size'])} ({info['size']} bytes)"),
        ("family", info["family"]),
        ("parameters", f"{_millions_or_billions(info['parameters'])} ({info['parameters']:,})"
                       + (f", {_millions_or_billions(info['active_parameters'])} active per token"
                          if info["active_parameters"] != info["parameters"] else "")),
        ("quantization", f"{info['quantization']} (tensors: {types})"),
        *([("runs as", _runs_as(info["requantized"]))] if info["requantized"] else []),
        ("context", info["context_length"]),
        ("embedding", info["embedding_length"]),
        ("layers", info["layers"]),
        ("heads", f"{info['heads']} (kv heads {info['kv_heads']}, head dim {info['head_dim']})"),
        ("footprint", footprint),
        ("labels", ", ".join(info["labels"]) or "-"),
    ]
    if record.system is not None:
        fields.append(("system", record.system if len(record.system) <= 60 else record.system[:57] + "..."))
    if record.effective_parameters():
        fields.append(("defaults", ", ".join(f"{k} {v}" for k, v in record.effective_parameters().items())))
    for key, value in fields:
        print(f"  {key:<13} {value}")
    template = info["chat_template"]
    if not template:
        print("  chat template (none)")
        return 0
    lines = template.splitlines()
    shown = lines if args.template else lines[:TEMPLATE_PREVIEW_LINES]
    cut = "" if len(shown) == len(lines) else f" (first {len(shown)} of {len(lines)} lines; --template for all)"
    print(f"  chat template{cut}")
    for line in shown:
        print(f"    {line}")
    return 0


def cmd_check(args) -> int:
    from kiln.engine import native, repack_cache
    from kiln.store import Store

    store = Store()
    results = store.verify(args.model, progress=True)
    if not results:
        print("no models installed")
    caches: dict[str, tuple[bool, str]] = {}  # by blob: the tags of one file share its repack cache
    all_ok = True
    for tag, ok, message in results:
        found = [(ok, message)]
        if ok and native.available():
            record = store.resolve(tag)
            if record.sha256 not in caches:
                caches[record.sha256] = repack_cache.verify(store.cache_dir(record), record.sha256,
                                                            native.cache_version())
            found.append(caches[record.sha256])
        for ok, message in found:
            all_ok &= ok
            if ok:
                print(f"{tag}: {message}")
            else:
                print(f"kiln: error: {tag}: {message}", file=sys.stderr)
    return 0 if all_ok else 1
