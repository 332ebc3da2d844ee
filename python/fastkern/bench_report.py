"""The README's results table: headline cases of a `fastkern.bench` report as Markdown.

`python -m fastkern.bench --markdown FILE.json` prints it from a saved report; without a file it
times the suites first. One row per op, dtype and direction at a few representative shapes; the full
report (about 70 cases a card) stays in the JSON and in the plain table of `python -m fastkern.bench`.
Needs only the report (a dict as `bench.run` returns and `--out` writes), not torch or a GPU.
"""
import re

# Headline cases, in table order: (op and direction, shape pattern). Patterns leave the leading dim
# free, so a --quick or CPU run (leading dims / 16, GELU 2^22) selects the same rows.
HEADLINE = [
    ("gelu tanh fwd", r"2\^\d+"),
    ("gelu tanh bwd", r"2\^\d+"),
    ("bias+gelu fwd+bwd", r"\(\d+,4096\)"),
    ("softmax fwd", r"\(\d+,4096\)"),            # rows of 4096, the headline shape
    ("softmax bwd", r"\(\d+,4096\)"),
    ("softmax scale+causal fwd", r"\(\d+,\d+,\d+,\d+\)"),
]
# The CPU suite (`--device cpu`, torch eager only): the same ops at the rows of 4096, plus the erf GELU
# forward (the CPU's weakest GELU); the JSON holds the other shapes and the columns (dim 0).
HEADLINE_CPU = [
    ("gelu tanh fwd", r"2\^\d+"), ("gelu tanh bwd", r"2\^\d+"), ("gelu erf fwd", r"2\^\d+"),
    ("bias+gelu fwd+bwd", r"\(\d+,\d+\)"),
    ("softmax fwd", r"\(1024,4096\)"), ("softmax bwd", r"\(1024,4096\)"),
    ("softmax scale+causal fwd", r"\(\d+,\d+,\d+,\d+\)"),
]
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}
_NAME = re.compile(r"^(?P<op>.+?) (?P<dtype>float32|bfloat16|float16|bf16|fp16) (?P<shape>.+)$")


def parse_case(name):
    """(op and direction, short dtype, shape) of a case name such as 'softmax bwd bfloat16 (16384,4096)'."""
    m = _NAME.match(name)
    if m is None:
        return name, "", ""
    return m["op"], DTYPES[m["dtype"]], m["shape"]


def headline_cases(report):
    """The report's headline cases in table order: by op and direction (HEADLINE's order), then
    dtype (fp32 first), then shape. Every case where none matches (e.g. an --only run)."""
    headline = HEADLINE_CPU if report.get("device") == "cpu" else HEADLINE
    ops = list(dict.fromkeys(op for op, _ in headline))
    dtype_order = {"fp32": 0, "fp16": 1, "bf16": 2}
    picked = []
    for c in report["cases"]:
        op, dtype, shape = parse_case(c["case"])
        for rank, (want_op, pattern) in enumerate(headline):
            if op == want_op and re.fullmatch(pattern, shape):
                picked.append(((ops.index(op), dtype_order.get(dtype, 3), rank), c))
                break
    if not picked:
        return list(report["cases"])
    return [c for _, c in sorted(picked, key=lambda t: t[0])]


def _us(ms):
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _x(ratio):
    return "-" if ratio is None else f"{ratio:.3f}x"


def markdown(report, source=None):
    """The headline table as Markdown, under one line naming the device, its copy ceiling, torch,
    the date and `source` (the JSON file) when given."""
    head = (f"{report['device']}, copy {report['ceilings']['copy_gbs']:.0f} GB/s, "
            f"torch {report['torch']}, {report['date'][:10]}" + (f", `{source}`" if source else ""))
    cases = headline_cases(report)
    compiled = any("compile" in c["ms"] for c in cases)  # the CPU suite has torch eager only
    if compiled:
        lines = [head, "",
                 "| case | dtype | shape | fastkern us | eager us | compile us | vs eager | vs compile | % of copy |",
                 "|---|---|---|--:|--:|--:|--:|--:|--:|"]
    else:
        lines = [head, "", "| case | dtype | shape | fastkern us | eager us | vs eager | % of copy |",
                 "|---|---|---|--:|--:|--:|--:|"]
    for c in cases:
        op, dtype, shape = parse_case(c["case"])
        ms, vs = c["ms"], c["speedup_vs"]
        if compiled:
            lines.append(f"| {op} | {dtype} | {shape} | {_us(ms['fastkern'])} | {_us(ms.get('torch'))} | "
                         f"{_us(ms.get('compile'))} | {_x(vs.get('torch'))} | {_x(vs.get('compile'))} | "
                         f"{c['pct_of_copy']:.1f} |")
        else:
            lines.append(f"| {op} | {dtype} | {shape} | {_us(ms['fastkern'])} | {_us(ms.get('torch'))} | "
                         f"{_x(vs.get('torch'))} | {c['pct_of_copy']:.1f} |")
    if "host_overhead_us" in report and not compiled:
        lines += ["", "Host time of a tiny call, fastkern / torch: " + ", ".join(
            f"{k} {v['fastkern']:.1f} / {v['torch']:.1f} us ({v['ratio']:.2f}x)"
            for k, v in report["host_overhead_us"].items())]
    return "\n".join(lines)
