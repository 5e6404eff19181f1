"""explain's table: lines within about 100 columns, plurals, reductions first among a region's ops, the
reasons ops stay with XLA grouped and counted, counts that add up, and each region's reason with its
kind (plan.layout.ReasonKind) and the op it names. On the CPU, with NVRTC."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch import targets
from jaxstitch.bench.workloads import layernorm_fwdbwd
from jaxstitch.driver.report import WIDTH, RegionReport, Report, key_ops
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.graph.partition import partition
from jaxstitch.kernels import nvrtc
from jaxstitch.kernels.cache import Stats
from jaxstitch.plan import planner, views
from jaxstitch.plan.layout import ReasonKind, Unplannable, place
from jaxstitch.plan.tile import NotATile

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed")
S = jax.ShapeDtypeStruct
X, G = S((256, 1024), jnp.float32), S((1024,), jnp.float32)


def mostly_xla(x, w):
    """Products, sorts and a column cumsum: equations left to XLA for several reasons."""
    y = x @ w
    z = jnp.sort(y, -1) + jnp.sort(x, -1)
    return jnp.cumsum(z, 0) @ w, jnp.argsort(y, -1), (x @ w.T) @ w


def _too_wide(text: str) -> list[str]:
    """Lines past WIDTH that a shorter wrap could have avoided (a single word longer than a line may
    pass it)."""
    return [ln for ln in text.splitlines() if len(ln) > WIDTH and len(max(ln.split(), key=len)) < WIDTH // 2]


def _region(**kw) -> RegionReport:
    base = dict(index=0, ops=("mul",), stitched=False, kernels=1, scheme=None, mapping=None, rows=None,
                cols=None, grid=None, block=None, est_bytes=None, est_us=None, xla_kernels=1, xla_est_us=None,
                reason=None, cache_key=None)
    return RegionReport(**{**base, **kw})


@pytest.fixture(scope="module")
def layernorm():
    return jaxstitch.explain(layernorm_fwdbwd, X, G, G, X, target="h100")


@pytest.fixture(scope="module")
def xla_heavy():
    return jaxstitch.explain(mostly_xla, S((256, 256), jnp.float32), S((256, 256), jnp.float32), target="h100")


@needs_nvrtc
def test_a_one_region_plan_speaks_in_the_singular(layernorm):
    text = str(layernorm)
    head = text.splitlines()[0]
    assert head == "jaxstitch plan for h100: 1 region: 1 stitched into 1 kernel", text
    assert not re.search(r"\b1 (regions|kernels|equations|compiles|threads)\b", text), text
    assert not _too_wide(text), text


@needs_nvrtc
def test_the_head_counts_add_up(layernorm):
    text = str(layernorm)
    cubins = re.search(r"^cubins: (\d+) compiled by NVRTC, (\d+) from the disk cache, (\d+) from memory",
                       text, re.M)
    c = layernorm.cache
    assert cubins and tuple(map(int, cubins.groups())) == (c.nvrtc_compiles, c.disk_hits, c.memory_hits), text
    built = re.search(r"^built in ([\d.]+) s(, NVRTC running for ([\d.]+) s of them \(([\d.]+) s of CPU "
                      r"time on up to \d+ threads?\))?$", text, re.M)
    assert built, text
    if c.nvrtc_compiles:  # (NVRTC's wall time is within the build's; its CPU time may exceed both)
        assert built.group(2) and float(built.group(3)) <= float(built.group(1)), text
        assert float(built.group(4)) == pytest.approx(c.nvrtc_seconds, abs=0.01), text


def test_head_counts_regions_left_to_xla():
    regions = (_region(stitched=True, index=0), _region(index=1, reason="why"), _region(index=2, reason="why"))
    report = Report("h100", regions, ())
    assert str(report).splitlines()[0] == "jaxstitch plan for h100: 3 regions: 1 stitched into 1 kernel, 2 left to XLA"
    assert str(Report("h100", regions[1:], ())).splitlines()[0] == "jaxstitch plan for h100: 2 regions, none stitched"
    busy = Report("h100", regions, (), Stats(7, 2, 1, 9.5, 3.25), seconds=4.0)
    lines = str(busy).splitlines()
    assert lines[1] == "cubins: 7 compiled by NVRTC, 1 from the disk cache, 2 from memory"
    assert lines[2].startswith("built in 4.00 s, NVRTC running for 3.25 s of them (9.50 s of CPU time on up to")


@needs_nvrtc
def test_reasons_left_to_xla_are_grouped_and_counted(xla_heavy):
    text = str(xla_heavy)
    assert not _too_wide(text), text
    block = text[text.index("\nleft to XLA ("):].splitlines()[1:]
    total = int(re.search(r"^left to XLA \((\d+) equations?\):$", text, re.M).group(1))
    counted = [int(m.group(1)) for ln in block if (m := re.search(r": (\d+) equations?$", ln))]
    assert sum(counted) == total == sum(xla_heavy.xla_counts), text
    assert len(counted) == len({why.removeprefix(p) for p, why in xla_heavy.xla_ops}), text
    dots = [ln for ln in block if ln.lstrip().startswith("dot_general is compute-intensive")]
    assert len(dots) == 1 and dots[0].endswith(": 4 equations"), text


def test_a_group_of_primitives_shares_a_line_and_wraps_between_them():
    pairs = tuple((p, f"{p} is not a stitchable primitive") for p in
                  ("gather", "random_fold_in", "random_unwrap", "scatter-add", "another_long_primitive_name"))
    report = Report("h100", (), pairs, xla_counts=(5, 37, 37, 3, 1))
    lines = str(report).splitlines()
    assert lines[1] == "left to XLA (83 equations):"
    assert lines[2].startswith("  gather x5, random_fold_in x37, random_unwrap x37, scatter-add x3,")
    joined = " ".join(ln.strip() for ln in lines[2:])
    assert joined.endswith("another_long_primitive_name x1 is not a stitchable primitive: 83 equations")
    assert all(len(ln) <= WIDTH for ln in lines)
    assert not any(ln.rstrip().endswith((" x", "83")) for ln in lines)  # (never broken inside "gather x5")


def test_long_mappings_and_reasons_wrap_under_their_region():
    long_reason = "a reason " * 30
    report = Report("h100", (_region(reason=long_reason.strip(), mapping="block per row, " * 12,
                                     alternatives=("another mapping " * 10,)),), ())
    text = str(report)
    assert not _too_wide(text), text
    body = text.splitlines()[3:]
    assert body[0].startswith("    mapping: block per row,") and body[1].startswith("        ")
    assert any(ln.startswith("    reason: a reason") for ln in body)
    assert any(ln.startswith("    tried: another mapping") for ln in body)
    assert " ".join(ln.strip() for ln in body if not ln.startswith("    mapping")).count("a reason") == 30


def test_key_ops_put_reductions_first_and_count_the_rest():
    ops = ("mul",) * 5 + ("exp",) * 2 + ("reduce_sum", "reduce_max", "reduce_sum", "sub")
    assert key_ops(ops) == "11: reduce_sum x2, reduce_max, mul x5, exp x2, sub"
    short = key_ops(ops, width=40)
    assert short.startswith("11: reduce_sum x2, reduce_max") and len(short) <= 40, short
    shown = short.split(": ", 1)[1].split(", ")
    assert int(shown[-1].strip("+ more")) + len(shown) - 1 == 5, short  # every kind accounted for


@needs_nvrtc
def test_each_row_of_the_table_fits(layernorm, xla_heavy):
    for report in (layernorm, xla_heavy):
        head = [ln for ln in str(report).splitlines() if ln.startswith("#")]
        assert head and head[0].split() == ["#", "stitched", "kernels", "scheme", "rows", "x", "cols", "est",
                                            "us", "xla", "us", "ops"]
        assert all(len(ln) <= WIDTH for ln in str(report).splitlines() if re.match(r"\d+ ", ln))


def test_a_transpose_only_products_read_is_counted_as_no_kernel():
    """XLA folds a transpose of the two minor axes into the products that read it (its GPU
    TransposeFolding predicate); one read by anything else stays a kernel of XLA's."""
    S = jax.ShapeDtypeStruct
    x, w = S((512, 256), jnp.float32), S((1024, 256), jnp.float32)
    folded = jaxstitch.explain(lambda x, w: x @ w.T, x, w, target="h200")
    (t,) = [r for r in folded.regions if r.ops == ("transpose",)]
    assert t.kernels == 0 and not t.stitched and "XLA folds it" in t.reason
    kept = jaxstitch.explain(lambda x, w: (x @ w.T, w.T + 1.0), x, w, target="h200")
    assert all(r.kernels >= 1 for r in kept.regions if "transpose" in r.ops)


def _sum_over_outer_axes(x):
    y = jnp.exp(x) * 2.0
    return jnp.sum(y, axis=(0, 2)) + 1.0  # (a reduction over the first and last axes: no row space)


def test_a_reason_naming_an_op_shows_the_users_line():
    report = jaxstitch.explain(_sum_over_outer_axes, jax.ShapeDtypeStruct((64, 48, 320), jnp.float32), target="h200")
    (left,) = [r for r in report.regions if r.reason and "over axes (0, 2)" in r.reason]
    assert left.source.startswith(f"{__file__}:") and "(_sum_over_outer_axes)" in left.source
    assert f"at: {left.source}" in str(report)
    # a reason that names no op (the cost model's) shows no line
    assert all(not r.source for r in report.regions if r.reason and r.reason.startswith("XLA already"))


def _softmax_of_transpose(x):
    return jax.nn.softmax(x.T * 2, -1)  # (a transpose of the minor axis: no tiles for it in a row space)


def test_a_reason_met_while_sinking_a_view_names_the_op_being_sunk():
    report = jaxstitch.explain(_softmax_of_transpose, jax.ShapeDtypeStruct((640, 480), jnp.float32), target="h200")
    (left,) = [r for r in report.regions if r.reason and "walks its minor axis" in r.reason]
    assert "(_softmax_of_transpose)" in left.source


def _region_and_trace(fn, *specs, prim: str):
    """The trace of fn, and the region of its partition holding a `prim` op."""
    traced = trace_mod.trace(fn, list(specs), trace_mod.positional_tree(list(specs)))
    (region,) = [r for r in partition(traced.graph).regions if any(op.prim == prim for op in r.ops)]
    return traced, region


def test_a_reason_carries_its_kind_and_the_op_it_names():
    traced, region = _region_and_trace(_sum_over_outer_axes, S((64, 48, 320), jnp.float32), prim="reduce_sum")
    with pytest.raises(Unplannable) as refused:
        place(views.sink(region))
    e = refused.value
    assert (e.kind, str(e), e.detail) == (ReasonKind.LAYOUT, "reduce_sum over axes (0, 2)", str(e))
    assert traced.eqns[e.op_index].primitive.name == "reduce_sum"
    # (the tile plan's refusal, after the row space's: its kind is the region's, the op the row space's)
    plan = planner.plan_region(region, targets.get_target("h200"))
    assert (plan.reason_kind, plan.reason_op) == (ReasonKind.LAYOUT, e.op_index), plan.reason
    report = jaxstitch.explain(_sum_over_outer_axes, S((64, 48, 320), jnp.float32), target="h200")
    kinds = {r.reason_kind: r for r in report.regions}
    assert set(kinds) == {"layout", "cost"}, report
    assert kinds["cost"].reason.startswith("XLA already") and not kinds["cost"].source
    assert "left to XLA by kind of reason: cost 1, layout 1" in str(report).splitlines()


def test_a_reason_met_while_sinking_a_view_keeps_its_kind_and_names_the_op():
    """No batch of tiles (NotATile) for two axes: the row space's reason stands, with its kind."""
    traced, region = _region_and_trace(_softmax_of_transpose, S((640, 480), jnp.float32), prim="transpose")
    plan = planner.plan_region(region, targets.get_target("h200"))
    assert "walks its minor axis" in plan.reason and plan.reason_kind is ReasonKind.LAYOUT
    assert traced.eqns[plan.reason_op].primitive.name == "transpose"
    assert NotATile("no batch of tiles").kind is ReasonKind.TILE


def test_every_unplannable_names_a_kind_of_the_closed_set():
    """Each Unplannable(...) in the package passes a ReasonKind member first (NotATile's is always
    TILE), so every reason the planner gives can be grouped without reading its text. COST is the
    cost model's, on RegionPlan: never raised."""
    package = pathlib.Path(__file__).resolve().parents[1] / "jaxstitch"
    sites, unnamed = {}, []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("Unplannable", "NotATile")):
                continue
            first = node.args[0] if node.args else None
            if node.func.id == "NotATile":
                kind = "TILE"
            elif (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
                  and first.value.id == "ReasonKind" and first.attr in ReasonKind.__members__):
                kind = first.attr
            else:
                unnamed.append(f"{path.relative_to(package)}:{node.lineno}")
                continue
            sites[kind] = sites.get(kind, 0) + 1
    assert not unnamed, unnamed
    assert sum(sites.values()) > 70 and "COST" not in sites, sites
    with pytest.raises(ValueError):
        Unplannable("a kind outside the set", "detail")


def test_the_regions_left_to_xla_are_counted_by_the_kind_of_their_reason():
    assert "reason_kind" in {f.name for f in dataclasses.fields(RegionReport)}
    regions = (_region(stitched=True, index=0), _region(index=1, reason="a", reason_kind="layout"),
               _region(index=2, reason="b", reason_kind="cost"), _region(index=3, reason="c", reason_kind="layout"),
               _region(index=4, reason="NVRTC: an error"))
    lines = str(Report("h100", regions, ())).splitlines()
    assert lines[0] == "jaxstitch plan for h100: 5 regions: 1 stitched into 1 kernel, 4 left to XLA"
    assert lines[1] == "left to XLA by kind of reason: layout 2, cost 1"
