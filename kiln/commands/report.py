"""`kiln report`: a static HTML page of the bench history (see kiln.bench.report)."""

from __future__ import annotations


def register(sub) -> None:
    from kiln.bench import report

    p = sub.add_parser("report", help="write an HTML page of the bench history: plots, comparisons, provenance",
                       description=report.__doc__.split("\n\n")[0])
    report.add_arguments(p)
    p.set_defaults(func=lambda args: report.main(args))
