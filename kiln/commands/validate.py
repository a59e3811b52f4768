"""`kiln validate`: check this machine for kiln and measure what it delivers (see kiln/validate.py)."""

from __future__ import annotations

import json
import sys

STATUS_STYLE = {"passed": "[green]PASSED[/]", "failed": "[red]FAILED[/]", "warning": "[yellow]WARNING[/]",
                "info": "[cyan]INFO[/]"}


def register(sub) -> None:
    p = sub.add_parser("validate", help="check this machine and self-test the kernels (like flm validate)",
                       description="Platform checks (extension, CPU features and kernel variant, threads, huge pages, "
                                   "memlock, memory and a model fit) and kernel self-tests with figures. "
                                   "Exit status 0 when ready, 1 when not.")
    p.add_argument("--model", help="tag or .gguf path to check for fit (not loaded; read from its GGUF)")
    p.add_argument("-c", "--ctx", type=int, help="context length for the fit check (default min(model's, 4096))")
    p.add_argument("--slots", type=int, default=1, help="KV slots (parallel sequences) for the fit check")
    p.add_argument("--kv-cache", help="KV cache type for the fit check: f16, q8_0 or q4_0 (env KILN_KV_CACHE_TYPE; "
                                      "default f16)")
    p.add_argument("-t", "--threads", type=int, help="threads for the self-tests (default: physical cores)")
    p.add_argument("--quick", action="store_true", help="smaller buffers and fewer repetitions")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    from kiln.validate import validate

    if args.threads is not None and args.threads < 1:
        raise SystemExit("kiln validate: --threads must be at least 1")
    if args.slots < 1:
        raise SystemExit("kiln validate: --slots must be at least 1")
    report = validate(args.model, args.ctx, args.slots, args.threads, args.quick, kv_cache=args.kv_cache)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        render(report)
    return 0 if report["ready"] else 1


def render(report: dict, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout)
    m = report["machine"]
    console.print(f"[bold]kiln validate[/] · kiln {report['kiln_version']} · {m['cpu']} · {m['os']} · "
                  f"python {m['python']}")
    table = Table(show_lines=True, expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("result, and how it was measured")
    for c in report["checks"]:
        table.add_row(c["name"], STATUS_STYLE[c["status"]], f"{c['result']}\n[dim]how: {c['method']}[/]")
    console.print(table)
    fit = report["model_fit"]
    why = []
    if not any(c["name"] == "native extension" and c["status"] == "passed" for c in report["checks"]):
        why.append("the native extension is not built")
    if any(c["name"] == "kernel correctness" and c["status"] == "failed" for c in report["checks"]):
        why.append("a kernel disagrees with numpy")
    if fit is not None and "error" in fit:
        why.append(f"{fit['model']}: {fit['error']}")
    elif fit is not None and not fit["fits"]:
        why.append(f"{fit['model']} does not fit")
    console.print("[bold green]Ready.[/]" if report["ready"] else f"[bold red]Not ready:[/] {'; '.join(why)}.")
