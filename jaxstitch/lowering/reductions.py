"""Row reductions (per-thread partials, warp shuffles, one round through shared memory, and for a
split row the slices' partials through the workspace) and the accumulation of grid reductions."""
from __future__ import annotations

from ..core import ir
from ..core import ops as opdefs
from ..plan.layout import COL, FULL
from .cuda_ops import ARG_REDUCE, CTYPE, REDUCE, as_stored, expression, literal
from .kernel import Kernel, Writer, col_index


def reduce_init(k: Kernel, w: Writer, ops: list[ir.Op]):
    """Per-thread partials of the row reductions finishing in this phase."""
    for op in ops:
        o = op.outputs[0]
        if op.prim == opdefs.VARIADIC:
            for out, init in zip(op.outputs, op.inputs[len(op.outputs):]):
                w(f"{k.ctype(out)} p{out.id} = {literal(init.value, out.dtype)};")
        elif op.prim in ARG_REDUCE:
            kind = "reduce_max" if ARG_REDUCE[op.prim] == "true" else "reduce_min"
            w(f"float p{o.id} = {REDUCE[kind][1]['float']}; int q{o.id} = 0x7fffffff;")
        else:
            w(f"{k.ctype(o)} p{o.id} = {REDUCE[op.prim][1][k.ctype(o)]};")


def reduce_accumulate(k: Kernel, w: Writer, ops: list[ir.Op]):
    """Fold this thread's elements (of the current chunk) into its partials."""
    for op in ops:
        src, o = op.inputs[0], op.outputs[0]
        if o.id in k.online_by_sum:  # folded in with its max's
            continue
        if o.id in k.online_by_max:
            _online_accumulate(k, w, op)
            continue
        if op.prim == opdefs.VARIADIC:
            elems = [f"({k.ctype(out)})({as_stored(a, k.ref(a))})" for out, a in zip(op.outputs, op.inputs)]
            args = f"({_partials(op)}, {', '.join(elems)});"
            first, later = combiner(k, op), combiner(k, op, _column_indices(k, op))
            k.each_element(w, f"{first}{args}" if later == first else
                           f"if (e == 0) {first}{args} else {later}{args}")
        elif op.prim in ARG_REDUCE:
            args = f"(p{o.id}, q{o.id}, (float){as_stored(src, k.ref(src))}, {col_index('e')});"
            fold = f"js_arg_combine<{ARG_REDUCE[op.prim]}>{args}"
            k.each_element(w, f"if (e == 0) {fold} else js_arg_combine<{ARG_REDUCE[op.prim]}, true>{args}"
                           if _ascending(k) else fold)
        else:
            fn, ct = REDUCE[op.prim][0], k.ctype(o)
            k.each_element(w, f"p{o.id} = {fn}(p{o.id}, ({ct}){k.ref(src)});")


def _ascending(k: Kernel) -> bool:
    """Whether a thread's elements of a chunk lie in ascending columns (each_element's order): not
    where a paired mapping interleaves two halves (plan/pairs.py)."""
    return not k.m.pair


def _column_indices(k: Kernel, op: ir.Op) -> frozenset[int]:
    """The operands of a variadic reduce that are each element's own column (an iota along the
    row), where a thread folds its elements in ascending columns: for every element after a chunk's
    first, such an operand is larger in the element than in the partials."""
    if not _ascending(k):
        return frozenset()
    c = k.layout.n_cols
    return frozenset(j for j, a in enumerate(op.inputs[:len(op.outputs)])
                     if isinstance(a, ir.Value) and k.layout.of(a).iota == (1, c)
                     and k.layout.of(a).storage == COL)


# A comparison of a partial's column index a with a later element's b (b > a), by its primitive and
# whether the element is its first operand.
_KNOWN = {("lt", True): "false", ("lt", False): "true", ("le", True): "false", ("le", False): "true",
          ("gt", True): "true", ("gt", False): "false", ("ge", True): "true", ("ge", False): "false",
          ("eq", True): "false", ("eq", False): "false", ("ne", True): "true", ("ne", False): "true"}


def combiner(k: Kernel, op: ir.Op, later: frozenset[int] = frozenset()) -> str:
    """The name of a device function folding a variadic reduce's elements into its partials, in place:
    the reduce's combiner (an ir.Graph over scalars, trace.py) rendered op by op. Defined once per
    kernel, before it (`k.functions`). `later`: operands that are column indices (`_column_indices`)
    of an element known to come after the partials' columns: comparisons between the two are
    rendered as the constants they are, so that an argmax's tie-break (the smaller index wins)
    folds away, as within a thread's ascending elements it never applies."""
    name = f"js_comb{op.outputs[0].id}" + ("_later" if later else "")
    if name in k.functions:
        return name
    graph, n = op.param("combiner"), len(op.outputs)
    names = {v.id: (f"a{i}" if i < n else f"b{i - n}") for i, v in enumerate(graph.inputs)}
    index_of = {graph.inputs[j].id: (j, False) for j in later}
    index_of.update({graph.inputs[n + j].id: (j, True) for j in later})

    def ref(a: ir.Atom) -> str:
        return literal(a.value, a.dtype) if isinstance(a, ir.Const) else names[a.id]

    def known(g: ir.Op) -> str | None:
        if len(g.inputs) != 2:
            return None
        x, y = (index_of.get(getattr(a, "id", None)) for a in g.inputs)
        if x is None or y is None or x[0] != y[0] or x[1] == y[1]:
            return None  # (not the same operand's partial and element)
        return _KNOWN.get((g.prim, x[1]))

    params = [f"{CTYPE[v.dtype]}& a{i}" for i, v in enumerate(graph.inputs[:n])]
    params += [f"const {CTYPE[v.dtype]} b{i}" for i, v in enumerate(graph.inputs[n:])]
    lines = [f"__device__ __forceinline__ void {name}({', '.join(params)}) {{"]
    for g in graph.ops:
        out = g.outputs[0]
        names[out.id] = f"c{out.id}"
        expr = known(g) or expression(g, [ref(a) for a in g.inputs])
        lines.append(f"  const {CTYPE[out.dtype]} c{out.id} = {expr};")
    # (all results first: an output may read an accumulator another one overwrites)
    lines += [f"  const {CTYPE[v.dtype]} r{i} = {ref(a)};" for i, (v, a) in enumerate(zip(graph.inputs, graph.outputs))]
    lines += [f"  a{i} = r{i};" for i in range(n)] + ["}"]
    k.functions[name] = "\n".join(lines)
    return name


def _partials(op: ir.Op, prefix: str = "p") -> str:
    return ", ".join(f"{prefix}{o.id}" for o in op.outputs)


def _variadic_group(k: Kernel, w: Writer, op: ir.Op):
    """A variadic reduce's partials across aligned groups of W lanes (butterfly shuffles). Each pair
    is combined lower lane first, so both lanes compute the same fold even for a combiner that is not
    commutative, and every lane of the group ends with the group's partials."""
    fn, outs = combiner(k, op), op.outputs
    w("#pragma unroll")
    w(f"for (int o = {min(k.m.tpr, 32)} / 2; o > 0; o >>= 1) {{")
    for out in outs:
        ct = k.ctype(out)
        shfl = f"__shfl_xor_sync(0xffffffffu, {'(int)' if ct == 'bool' else ''}p{out.id}, o)"
        w(f"  {ct} t{out.id} = {shfl}{' != 0' if ct == 'bool' else ''};")
    w(f"  if (lane & o) {{ {fn}({_partials(op, 't')}, {_partials(op)}); {' '.join(f'p{o.id} = t{o.id};' for o in outs)} }}")
    w(f"  else {fn}({_partials(op)}, {_partials(op, 't')});")
    w("}")


def _online_accumulate(k: Kernel, w: Writer, op: ir.Op):
    """A max and its online sums (plan/online.py): the chunk's max, the new running max, the chunk's
    exp(x - max) terms against it (times each weighted sum's g), and the partial sums so far
    rescaled to it. A max still -inf shifts by 0, so that -inf elements add exp(-inf) = 0 and no
    NaN is made from -inf - -inf."""
    pair = k.online_by_max[op.outputs[0].id]
    m, s, x = f"p{pair.max_id}", f"p{pair.sum_id}", f"(float){k.ref(op.inputs[0])}"
    sub, ex = k.producer[pair.diff_id], k.producer[pair.exp_id]

    def exp_minus(a, b):  # exp(a - b), written as the region writes it
        return k.expr(ex, [k.expr(sub, [a, b])])

    w("{  // online softmax: the max and the sum of exp(x - max) in one pass")
    inner = Writer(w.indent + 1)
    inner("float js_lm = -JS_INF;")
    k.each_element(inner, f"js_lm = js_max(js_lm, {x});")
    inner(f"const float js_mn = js_max({m}, js_lm), js_sh = js_lse_shift(js_mn);")
    inner("float js_t = 0.0f;")
    if not pair.weighted:
        k.each_element(inner, f"js_t += {exp_minus(x, 'js_sh')};")
        inner(f"{s} = {s} * {exp_minus(m, 'js_sh')} + js_t;")
    else:  # (sums of g * exp(x - max) beside it, rescaled by the same factor)
        values = ir.values_by_id(k.plan.region)  # (a region has a graph's inputs and ops)
        weights = [values[ws.weight_id] for ws in pair.weighted]
        inner(" ".join(f"float js_t{j} = 0.0f;" for j in range(len(weights))))
        terms = " ".join(f"js_t{j} += (float){k.ref(g)} * js_e;" for j, g in enumerate(weights))
        k.each_element(inner, f"{{ const float js_e = {exp_minus(x, 'js_sh')}; js_t += js_e; {terms} }}")
        inner(f"const float js_f = {exp_minus(m, 'js_sh')};")
        inner(f"{s} = {s} * js_f + js_t;")
        for j, ws in enumerate(pair.weighted):
            inner(f"p{ws.sum_id} = p{ws.sum_id} * js_f + js_t{j};")
    inner(f"{m} = js_mn;")
    w.lines.extend(inner.lines)
    w("}")


def _group_online(w: Writer, pair, width: int):
    """An online max and its sums across aligned groups of `width` lanes: every lane ends with the
    group's (js_group_lse for a pair alone)."""
    if not pair.weighted:
        w(f"js_group_lse<{width}>(p{pair.max_id}, p{pair.sum_id});")
        return
    w(f"{{ const float js_f = js_group_rescale<{width}>(p{pair.max_id});")
    for sid in pair.sum_ids:
        w(f"  p{sid} = js_group_reduce<{width}>(p{sid} * js_f, js_sum_op());")
    w("}")


def reduce_finish(k: Kernel, w: Writer, ops: list[ir.Op]):
    """Combine the partials across the row's threads: shuffles, then (rows wider than a warp) one
    round through shared memory for the whole batch of reductions (one barrier pair)."""
    if not ops:
        return
    slots = _group_partials(k, w, ops)
    if k.m.tpr > 32:
        _warps_round(k, w, slots)
    if k.split:
        combine_slices(k, w, slots)
    for op, _ in slots:
        pair = k.online_by_max.get(op.outputs[0].id)
        if pair and pair.finite_shift:  # a +inf max: the two-pass sum, shifted by 0, holds exp(+inf)
            w(f"if (p{pair.max_id} == JS_INF) p{pair.sum_id} = JS_INF;")
        elif pair:  # a row of -inf only: x - max is NaN in every term, as the two-pass sum has it
            w(f"if (p{pair.max_id} == -JS_INF) {{ {' '.join(f'p{sid} = JS_NAN;' for sid in pair.sum_ids)} }}"
              if pair.weighted else f"if (p{pair.max_id} == -JS_INF) p{pair.sum_id} = JS_NAN;")
    for op, kind in slots:
        o = op.outputs[kind[1]] if isinstance(kind, tuple) else op.outputs[0]
        w(f"const {k.ctype(o)} v{o.id} = {'q' if kind == 'arg' else 'p'}{o.id};")


def _group_partials(k: Kernel, w: Writer, ops: list[ir.Op]) -> list:
    """reduce_finish's first stage: each reduction's partials across the row's lanes of a warp
    (shuffles). Returns the slots, (op, kind) per partial, in the order later stages use them."""
    slots = []
    for op in ops:
        o = op.outputs[0]
        if op.prim == opdefs.VARIADIC:
            if k.m.tpr > 1:
                _variadic_group(k, w, op)
            slots += [(op, ("var", j)) for j in range(len(op.outputs))]
            continue
        kind = "arg" if op.prim in ARG_REDUCE else k.ctype(o)
        pair = k.online_by_max.get(o.id)
        if k.m.tpr > 1 and o.id in k.online_by_sum:
            pass  # combined with its max, as a pair
        elif k.m.tpr > 1 and pair:
            _group_online(w, pair, min(k.m.tpr, 32))
        elif k.m.tpr > 1 and kind == "arg":
            w(f"js_group_arg_reduce<{min(k.m.tpr, 32)}, {ARG_REDUCE[op.prim]}>(p{o.id}, q{o.id});")
        elif k.m.tpr > 1:
            w(f"p{o.id} = js_group_reduce<{min(k.m.tpr, 32)}>(p{o.id}, {REDUCE[op.prim][0]});")
        slots.append((op, kind))
    return slots


def _warps_round(k: Kernel, w: Writer, slots: list):
    """reduce_finish's round through shared memory, for rows wider than a warp: each warp's lane 0
    writes its partials, and after one barrier every thread folds the row's warps' partials."""
    k.n_row_red = max(k.n_row_red, len(slots))
    bank = k.smem_rounds % 2
    k.smem_rounds += 1
    _write_warp_partials(k, w, slots, bank)
    w("__syncthreads();")
    _read_warp_partials(k, w, slots, bank)
    if k.smem_rounds == k.barriers.rounds and k.barriers.last_round:
        w("__syncthreads();  // before js_red's bank is written again")


def _write_warp_partials(k: Kernel, w: Writer, slots: list, bank: int):
    """Lane 0 of every warp writes its partials to js_red / js_redi (bank `bank`), slot by slot."""
    w("if ((tid & 31) == 0) {")
    for i, (op, kind) in enumerate(slots):
        o = op.outputs[0].id
        if isinstance(kind, tuple):  # a variadic reduce's partial j
            out = op.outputs[kind[1]]
            arr = "js_red" if k.ctype(out) == "float" else "js_redi"
            w(f"  {arr}[{bank}][{i}][row_in_block][lane >> 5] = p{out.id};")
        elif kind == "arg":
            w(f"  js_red[{bank}][{i}][row_in_block][lane >> 5] = p{o}; js_redi[{bank}][{i}][row_in_block][lane >> 5] = q{o};")
        elif kind == "int":
            w(f"  js_redi[{bank}][{i}][row_in_block][lane >> 5] = p{o};")
        else:
            w(f"  js_red[{bank}][{i}][row_in_block][lane >> 5] = (float)p{o};")
    w("}")


def _read_warp_partials(k: Kernel, w: Writer, slots: list, bank: int):
    """Every thread folds the row's warps' partials (written by _write_warp_partials) into its own."""
    slot_of = {op.outputs[0].id: i for i, (op, _) in enumerate(slots)}
    for i, (op, kind) in enumerate(slots):
        o = op.outputs[0].id
        pair = k.online_by_max.get(o)
        if o in k.online_by_sum:
            continue
        if isinstance(kind, tuple):
            if kind[1] == 0:  # the warps' partials in warp order, all outputs at once
                _variadic_warps(k, w, op, bank, i)
            continue
        if pair and not pair.weighted:
            j, red = slot_of[pair.sum_id], f"js_red[{bank}]"
            w(f"js_warps_lse<NWARPS_ROW>(p{o}, p{pair.sum_id}, {red}[{i}][row_in_block], {red}[{j}][row_in_block]);")
        elif pair:  # lane j takes warp j's partials, then the group's fold
            red = f"js_red[{bank}]"
            w(f"p{o} = js_warp_partial<NWARPS_ROW>({red}[{i}][row_in_block], -JS_INF);")
            for sid in pair.sum_ids:
                w(f"p{sid} = js_warp_partial<NWARPS_ROW>({red}[{slot_of[sid]}][row_in_block], 0.0f);")
            _group_online(w, pair, 32)
        elif kind == "arg":
            w(f"p{o} = js_red[{bank}][{i}][row_in_block][0]; q{o} = js_redi[{bank}][{i}][row_in_block][0];")
            w(f"for (int j = 1; j < NWARPS_ROW; ++j) js_arg_combine<{ARG_REDUCE[op.prim]}>(p{o}, q{o}, js_red[{bank}][{i}][row_in_block][j], js_redi[{bank}][{i}][row_in_block][j]);")
        else:
            fn = REDUCE[op.prim][0]
            arr = "js_redi" if kind == "int" else "js_red"
            w(f"p{o} = {arr}[{bank}][{i}][row_in_block][0];")
            w(f"for (int j = 1; j < NWARPS_ROW; ++j) p{o} = {fn}(p{o}, ({kind}){arr}[{bank}][{i}][row_in_block][j]);")


def _variadic_warps(k: Kernel, w: Writer, op: ir.Op, bank: int, first: int):
    """Every thread folds the row's warp partials (slots first.. of js_red / js_redi) in warp order."""
    def at(j: int, warp: str) -> str:
        out = op.outputs[j]
        arr = "js_red" if k.ctype(out) == "float" else "js_redi"
        return f"({k.ctype(out)}){arr}[{bank}][{first + j}][row_in_block][{warp}]"

    n = len(op.outputs)
    for j, out in enumerate(op.outputs):
        w(f"p{out.id} = {at(j, '0')};")
    args = ", ".join(at(j, "j") for j in range(n))
    w(f"for (int j = 1; j < NWARPS_ROW; ++j) {combiner(k, op)}({_partials(op)}, {args});")


def combine_slices(k: Kernel, w: Writer, slots):
    """A split row: each block has reduced its slice; the slices' partials meet in the workspace,
    past a barrier of the row's blocks (js_row_group_sync: they wait for each other, not for the
    grid), and every block of the row combines them in slice order.

    A round's task of a block is the same (row in round, slice) pair, so a partial's slot is the
    block's; two sets of slots, by the parity of the barriers crossed, so that a block writing the
    next partials never meets one of its row still reading these (between them lies the row's
    barrier). The workspace thus does not depend on the row count (shape families)."""
    offsets = {g.value_id: g.offset for g in k.plan.split_partials}
    cap = k.m.grid_cap
    w("if (tid == 0 && row_ok) {")
    for op, kind in slots:
        o = op.outputs[0].id
        val = f"__int_as_float(p{o})" if kind == "int" else f"(float)p{o}"
        w(f"  js_ws[{offsets[o]} + (js_round & 1u) * {cap} + blockIdx.x] = {val};")
    w("}")
    w("++js_round;")
    w("if (blockIdx.x < js_step) js_row_group_sync(blockIdx.x / SPLITS, SPLITS, js_row_gen);")
    w("if (row_ok) {")
    def getter(o, kind):
        at = f"js_ws + {offsets[o]} + ((js_round - 1u) & 1u) * {cap} + (blockIdx.x / SPLITS) * SPLITS"
        return (lambda i: f"__float_as_int(__ldcg({at} + {i}))") if kind == "int" else (lambda i: f"__ldcg({at} + {i})")

    # Each warp folds the SPLITS partials lane-parallel (lane j: slices j, j + 32, ...) and then
    # across its lanes: one round of loads, not SPLITS dependent ones (64 slices folded one by one
    # took ~30 us a barrier on an H200). Every warp ends with the row's value.
    w("  const int js_l = tid & 31;")
    for op, kind in slots:
        o, fn = op.outputs[0].id, REDUCE[op.prim][0]
        pair, get = k.online_by_max.get(o), getter(o, kind)
        if o in k.online_by_sum:
            continue
        if pair and not pair.weighted:
            get_sum = getter(pair.sum_id, "float")
            w(f"  p{o} = -JS_INF; p{pair.sum_id} = 0.0f;")
            w(f"  for (int s = js_l; s < SPLITS; s += 32) js_lse_combine(p{o}, p{pair.sum_id}, {get('s')}, {get_sum('s')});")
            w(f"  js_group_lse<32>(p{o}, p{pair.sum_id});")
            continue
        if pair:  # (each slice's sums rescaled to the larger max, as js_lse_combine does)
            w(f"  p{o} = -JS_INF; {' '.join(f'p{sid} = 0.0f;' for sid in pair.sum_ids)}")
            folds = " ".join(f"p{sid} = p{sid} * js_f + {getter(sid, 'float')('s')} * js_f2;" for sid in pair.sum_ids)
            w(f"  for (int s = js_l; s < SPLITS; s += 32) {{ float js_f, js_f2; js_lse_rescale(p{o}, {get('s')}, js_f, js_f2); {folds} }}")
            inner = Writer(w.indent + 1)
            _group_online(inner, pair, 32)
            w.lines.extend(inner.lines)
            continue
        ctype = k.ctype(op.outputs[0])
        if ctype == "bool":  # (no shuffles of bool: folded one by one)
            w(f"  p{o} = {get(0)};")
            w(f"  for (int s = 1; s < SPLITS; ++s) p{o} = {fn}(p{o}, {get('s')});")
            continue
        w(f"  p{o} = {REDUCE[op.prim][1][ctype]};")
        w(f"  for (int s = js_l; s < SPLITS; s += 32) p{o} = {fn}(p{o}, {get('s')});")
        w(f"  p{o} = js_group_reduce<32>(p{o}, {fn});")
    w("}")


def grid_accumulate(k: Kernel, w: Writer, op: ir.Op):
    src, out = op.inputs[0], op.outputs[0]
    fn = REDUCE[op.prim][0]
    if k.placed(out).declared == COL:
        k.each_element(w, f"a{out.id}[e] = {fn}(a{out.id}[e], (float){k.ref(src)});", guard="row_ok")
    elif k.placed(src).declared == FULL:
        k.each_element(w, f"a{out.id} = {fn}(a{out.id}, (float){k.ref(src)});", guard="row_ok")
    else:
        w(f"if (row_ok && lane == 0 && ROW_C0 == 0) a{out.id} = {fn}(a{out.id}, (float){k.ref(src, '0')});")
