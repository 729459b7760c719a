"""Facts read from a GPU program's text: XLA:GPU's optimized HLO (``compiled.as_text()`` of a
deviceless compile) or the CUDA StableHLO a lowering for platform ``cuda`` gives
(``lowered.as_text()``). Pure functions of the text; no JAX, no device.

What is read (:func:`read_facts`):

* sorts: every ``sort`` with the size of its sorted dimension; one over the vocabulary (a size
  in ``vocab_dims``) is the full-vocabulary sort of a top-K. In StableHLO the top-K is still
  ``chlo.top_k``: XLA:GPU runs it with its TopK kernel only for k <= :data:`GPU_TOPK_MAX_K`,
  above that as a sort of (value, index) pairs over the whole axis, so a ``chlo.top_k`` with a
  larger k over the vocabulary counts as a vocabulary sort there (inferred, marked as such).
  A sort inside a branch of a conditional with two or more branches (``lax.cond``: e.g. an
  exact fallback taken only sometimes), or in a computation such a branch calls, is marked
  ``conditional``: it runs only when that branch is taken (a one-branch ``stablehlo.case``,
  e.g. ``lax.platform_dependent`` lowered for one platform, is not a condition);
* attention: the cuDNN custom calls ``__cudnn$fmha...`` (forward / backward), whether each
  takes a bias operand (``...Bias...``: a mask handed to cuDNN as an additive bias), whether
  the backward returns a ``dbias`` (an output besides dQ, dK, dV and the u8 workspace), the
  mask type from its backend config and the shapes;
* GEMMs: every ``dot`` / ``dot_general`` and cuBLAS custom call, with operand and result
  dtypes, shapes, FLOPs (2 x result elements x contracted size), the kind (``dot``,
  ``triton`` for a dot inside a Triton GEMM fusion, ``cublas``, ``cudnn`` for a cuDNN GEMM
  fusion) and the op name from the metadata;
* stacked per-layer arrays: the arrays the layer loops (``while``) carry whose leading axis is
  the layer count and whose shape is not a parameter's, i.e. what the backward reads per
  layer: the remat policy's saved tensors (plus anything else stacked per layer), deduplicated.

The HLO's shapes are per device (after SPMD partitioning), StableHLO's are global.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Collection, Iterable

# XLA:GPU's TopK custom kernel takes k <= 16; a larger k is sorted (issue 50).
GPU_TOPK_MAX_K = 16

_HLO_DTYPES = {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64",
               "ui8": "u8", "ui16": "u16", "ui32": "u32", "ui64": "u64"}
_ARRAY = re.compile(r"\b(pred|[a-z]+[0-9]+(?:e[0-9]m[0-9a-z]*)?)\[([0-9,]*)\]")
_TENSOR = re.compile(r"tensor<([^<>]*)>")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str  # HLO spelling: bf16, f32, s32, u8, pred
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class Sort:
    size: int  # the sorted dimension's size
    operand: Array
    over_vocab: bool
    via: str  # "sort", or "chlo.top_k k=N" (StableHLO, inferred from k > GPU_TOPK_MAX_K)
    conditional: bool = False  # in a branch of a conditional with 2+ branches (a fallback)


@dataclasses.dataclass(frozen=True)
class TopK:
    k: int
    size: int  # the axis it selects from
    via: str  # "chlo.top_k", "topk", or the custom call's target (e.g. "__gpu$TopK")


@dataclasses.dataclass(frozen=True)
class Attention:
    target: str  # e.g. "__cudnn$fmhaScaleBiasSoftmaxBackward"
    backward: bool
    bias: Array | None  # the bias operand (a mask handed to cuDNN as a bias)
    dbias: Array | None  # the backward's bias-gradient output
    mask_type: str | None  # from the backend config: CAUSAL, PADDING_CAUSAL, NO_MASK, ...
    query: Array | None
    seqlens: bool  # takes sequence-length operands (s32 [B] vectors)


@dataclasses.dataclass(frozen=True)
class Gemm:
    kind: str  # "dot" | "triton" | "cublas" | "cudnn"
    lhs: Array
    rhs: Array
    out: Array
    flops: float
    op_name: str = ""
    contracted: int = 0  # the product of the lhs's batch and contracting dimensions' sizes

    @property
    def signature(self) -> str:
        return f"{self.lhs.dtype} x {self.rhs.dtype} -> {self.out.dtype}"


@dataclasses.dataclass(frozen=True)
class Facts:
    program: str  # "xla_gpu_hlo" (a compile's optimized HLO) | "cuda_stablehlo" (a lowering)
    sorts: tuple[Sort, ...]
    topks: tuple[TopK, ...]
    attention: tuple[Attention, ...]
    gemms: tuple[Gemm, ...]
    stacked: tuple[Array, ...]  # per-layer arrays carried by loops (num_layers given)

    @property
    def vocab_sorts(self) -> tuple[Sort, ...]:
        return tuple(s for s in self.sorts if s.over_vocab)

    @property
    def unconditional_vocab_sorts(self) -> tuple[Sort, ...]:
        """Vocabulary sorts every execution runs (not in a branch of a conditional)."""
        return tuple(s for s in self.vocab_sorts if not s.conditional)

    @property
    def cudnn_forward(self) -> tuple[Attention, ...]:
        return tuple(a for a in self.attention if not a.backward)

    @property
    def cudnn_backward(self) -> tuple[Attention, ...]:
        return tuple(a for a in self.attention if a.backward)

    @property
    def dbias(self) -> tuple[Attention, ...]:
        return tuple(a for a in self.attention if a.dbias is not None)

    def gemm_signatures(self) -> dict[str, tuple[int, float]]:
        """``"bf16 x bf16 -> f32"`` -> (count, FLOPs), largest FLOPs first."""
        n: Counter[str] = Counter()
        f: dict[str, float] = {}
        for g in self.gemms:
            n[g.signature] += 1
            f[g.signature] = f.get(g.signature, 0.0) + g.flops
        return {k: (n[k], f[k]) for k in sorted(n, key=lambda s: -f[s])}

    def gemms_touching(self, dims: Collection[int], dtype: str | None = None
                       ) -> tuple[Gemm, ...]:
        """GEMMs with an operand or result axis that is a multiple of one of ``dims`` (e.g.
        the vocabulary: the LM head's; XLA may fuse the student's and the teacher's heads
        into one GEMM over 2 x V), or whose batch x contracting size is one (XLA may split
        the vocabulary axis of the head's backward into a batch and a contracting axis);
        with both operands of ``dtype`` when given."""
        d = [int(x) for x in dims if x > 0]

        def hit(n: int) -> bool:
            return n > 0 and any(n % v == 0 for v in d)

        return tuple(g for g in self.gemms
                     if (any(hit(x) for a in (g.lhs, g.rhs, g.out) for x in a.shape)
                         or hit(g.contracted))
                     and (dtype is None or g.lhs.dtype == g.rhs.dtype == dtype))


def vocab_dims(vocab: int, shards: Iterable[int] = ()) -> frozenset[int]:
    """The sizes a vocabulary axis has: the vocabulary and its even splits over ``shards``
    (per-device HLO of a vocab-sharded head)."""
    out = {int(vocab)}
    for s in shards:
        if s > 1 and vocab % s == 0:
            out.add(vocab // s)
    return frozenset(out)


def read_facts(text: str, vocab: Collection[int], num_layers: int | None = None) -> Facts:
    """The facts of one program text (HLO or StableHLO, told apart by their first lines);
    ``vocab``: the sizes a vocabulary axis has (:func:`vocab_dims`)."""
    head = text.lstrip()[:200]
    if head.startswith("module") or "func.func" in text[:5000]:
        return _read_stablehlo(text, frozenset(vocab), num_layers)
    if head.startswith("HloModule") or "ENTRY" in text:
        return _read_hlo(text, frozenset(vocab), num_layers)
    raise ValueError("neither an HLO module (HloModule ...) nor a StableHLO module (module ...)")


# ----------------------------------------------------------------------------------- helpers
def _prod(xs: Iterable[int]) -> int:
    return math.prod(xs) if xs else 1


def _contracted(lhs: Array, lhs_contracting: Iterable[int]) -> int:
    return _prod([lhs.shape[i] for i in lhs_contracting if i < len(lhs.shape)])


def _gemm(kind: str, lhs: Array, rhs: Array, out: Array, contracting: list[int],
          op_name: str = "", batch: Iterable[int] = ()) -> Gemm:
    k = _contracted(lhs, contracting)
    return Gemm(kind, lhs, rhs, out, 2.0 * _prod(out.shape) * k, op_name,
                k * _contracted(lhs, batch))


def _hlo_arrays(type_text: str) -> list[Array]:
    return [Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in _ARRAY.finditer(type_text)]


def _tensor(body: str) -> Array:
    """``8x64xbf16`` (the inside of ``tensor<...>``; an encoding after a comma ignored)."""
    parts = body.split(",")[0].strip().split("x")
    dt = parts[-1]
    dims = tuple(int(p) if p.isdigit() else -1 for p in parts[:-1])
    return Array(_HLO_DTYPES.get(dt, dt), dims)


def _tensors(text: str) -> list[Array]:
    return [_tensor(m.group(1)) for m in _TENSOR.finditer(text)]


def _balanced(s: str, start: int) -> int:
    """Index just past the bracket group opening at ``s[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}", "<": ">"}
    open_ch = s[start]
    close = pairs[open_ch]
    depth = 0
    for i in range(start, len(s)):
        if s[i] == open_ch:
            depth += 1
        elif s[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def _mask_type(cfg: str) -> str | None:
    m = re.search(r'"mask_type"\s*:\s*"([A-Z_]+)"', cfg.replace("\\22", '"'))
    return m.group(1) if m else None


def _attention(target: str, operands: list[Array], results: list[Array],
               backend_config: str) -> Attention:
    backward = target.endswith("Backward")
    has_bias = "Bias" in target
    q = operands[0] if operands else None
    # forward {Q, K, V, bias*, seqlens*...}; backward {Q, K, V, activation, dO, bias*, O, ...}
    bias_at = 5 if backward else 3
    bias = operands[bias_at] if has_bias and len(operands) > bias_at else None
    outs = [r for r in results if r.dtype != "u8"]  # the workspace is u8
    dbias = outs[3] if backward and len(outs) > 3 else None
    seqlens = any(len(o.shape) == 1 and o.dtype == "s32" for o in operands)
    return Attention(target, backward, bias, dbias, _mask_type(backend_config), q, seqlens)


def _stacked(loop_types: Iterable[Array], params: Iterable[Array], num_layers: int | None
             ) -> tuple[Array, ...]:
    if not num_layers:
        return ()
    pshapes = {p.shape for p in params}
    seen: dict[Array, None] = {}
    for a in loop_types:
        if len(a.shape) >= 2 and a.shape[0] == num_layers and a.shape not in pshapes:
            seen[a] = None
    return tuple(sorted(seen, key=lambda a: (-_prod(a.shape), str(a))))


# --------------------------------------------------------------------------------------- HLO
@dataclasses.dataclass
class _Instr:
    name: str
    types: list[Array]  # the result (a tuple's elements in order)
    opcode: str
    operands: list[str]
    attrs: str
    computation: str


def _parse_hlo(text: str) -> tuple[list[_Instr], dict[str, dict[str, list[Array]]], str]:
    instrs: list[_Instr] = []
    symbols: dict[str, dict[str, list[Array]]] = {}
    comp, entry = "", ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("//") or line.startswith("HloModule"):
            continue
        if line.endswith("{") and "=" not in line.split("(")[0]:
            is_entry = line.startswith("ENTRY")
            comp = line.removeprefix("ENTRY").strip().split(" ")[0].lstrip("%")
            if is_entry:
                entry = comp
            symbols.setdefault(comp, {})
            continue
        if line == "}":
            continue
        m = re.match(r"(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
        if not m:
            continue
        rest = line[m.end():]
        if rest.startswith("("):
            end = _balanced(rest, 0)
        else:
            end = rest.find(" ")
            end = len(rest) if end < 0 else end
        type_text, rest = rest[:end], rest[end:].lstrip()
        om = re.match(r"([a-z][\w\-]*)\(", rest)
        if not om:
            continue
        close = _balanced(rest, om.end() - 1)
        ops_text = re.sub(r"/\*.*?\*/", "", rest[om.end():close - 1])
        operands = [t.strip().split(" ")[-1].lstrip("%") for t in _split_top(ops_text)]
        ins = _Instr(m.group(1), _hlo_arrays(type_text), om.group(1), operands,
                     rest[close:], comp)
        symbols.setdefault(comp, {})[ins.name] = ins.types
        instrs.append(ins)
    return instrs, symbols, entry


def _split_top(s: str) -> list[str]:
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return [o for o in out if o.strip()]


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{re.escape(key)}=", attrs)
    if not m:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] in "{\"":
        if attrs[i] == '"':
            j = attrs.find('"', i + 1)
            return attrs[i + 1:j]
        return attrs[i:_balanced(attrs, i)]
    stop = re.search(r"[,\s]", attrs[i:])
    return attrs[i:i + stop.start()] if stop else attrs[i:]


def _dims(attr: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", attr or "")]


def _op_name(attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


_CALL_ATTRS = ("calls", "to_apply", "body", "condition", "branch_computations",
               "true_computation", "false_computation")


def _hlo_conditional_computations(instrs: list[_Instr]) -> set[str]:
    """Computations that run only when a branch of a ``conditional`` is taken: its branch
    computations (two or more) and everything they call."""
    calls: dict[str, set[str]] = {}
    roots: set[str] = set()
    for ins in instrs:
        branches: set[str] = set()
        for key in _CALL_ATTRS:
            v = _attr(ins.attrs, key)
            if v:
                names = set(re.findall(r"%?([\w.\-]+)", v))
                calls.setdefault(ins.computation, set()).update(names)
                if ins.opcode == "conditional" and key != "to_apply":
                    branches |= names
        if len(branches) >= 2:
            roots |= branches
    return _closure(roots, calls)


def _closure(roots: set[str], calls: dict[str, set[str]]) -> set[str]:
    out, todo = set(roots), list(roots)
    while todo:
        for c in calls.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _read_hlo(text: str, vocab: frozenset[int], num_layers: int | None) -> Facts:
    instrs, symbols, entry = _parse_hlo(text)

    def types_of(ins: _Instr, i: int) -> list[Array]:
        if i >= len(ins.operands):
            return []
        return symbols.get(ins.computation, {}).get(ins.operands[i], [])

    def first(ins: _Instr, i: int) -> Array | None:
        t = types_of(ins, i)
        return t[0] if t else None

    fusion_kind: dict[str, str] = {}
    for ins in instrs:
        if ins.opcode == "fusion":
            calls = (_attr(ins.attrs, "calls") or "").lstrip("%")
            km = re.search(r'"kind"\s*:\s*"([^"]+)"', ins.attrs)
            if calls and km:
                fusion_kind[calls] = km.group(1)
    cond = _hlo_conditional_computations(instrs)
    sorts, topks, attn, gemms, loops = [], [], [], [], []
    for ins in instrs:
        if ins.opcode == "sort" and ins.types:
            d = _dims(_attr(ins.attrs, "dimensions"))
            a = ins.types[0]
            size = a.shape[d[0]] if d and d[0] < len(a.shape) else (a.shape or (0,))[-1]
            sorts.append(Sort(size, a, size in vocab, "sort", ins.computation in cond))
        elif ins.opcode == "topk":
            src = first(ins, 0)
            k = int(_attr(ins.attrs, "k") or 0)
            topks.append(TopK(k, src.shape[-1] if src and src.shape else 0, "topk"))
        elif ins.opcode == "custom-call":
            target = _attr(ins.attrs, "custom_call_target") or ""
            ops = [a for i in range(len(ins.operands)) for a in types_of(ins, i)[:1]]
            if target.startswith("__cudnn$fmha"):
                attn.append(_attention(target, ops, ins.types,
                                       _attr(ins.attrs, "backend_config") or ""))
            elif "topk" in target.lower():
                k = ins.types[0].shape[-1] if ins.types and ins.types[0].shape else 0
                topks.append(TopK(k, ops[0].shape[-1] if ops and ops[0].shape else 0,
                                  target))
            elif target.startswith("__cublas") and len(ops) >= 2 and ins.types:
                cfg = _attr(ins.attrs, "backend_config") or ""
                cm = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', cfg)
                gemms.append(_gemm("cublas", ops[0], ops[1], ins.types[0],
                                   _dims(cm.group(1) if cm else ""), _op_name(ins.attrs)))
        elif ins.opcode == "dot" and ins.types:
            lhs, rhs = first(ins, 0), first(ins, 1)
            if lhs is None or rhs is None:
                continue
            kind = fusion_kind.get(ins.computation, "")
            label = ("triton" if "triton" in kind else "cudnn" if "cudnn" in kind else "dot")
            gemms.append(_gemm(label, lhs, rhs, ins.types[0],
                               _dims(_attr(ins.attrs, "lhs_contracting_dims")),
                               _op_name(ins.attrs), _dims(_attr(ins.attrs, "lhs_batch_dims"))))
        elif ins.opcode == "while":
            loops.extend(ins.types)
    params = [t for ins in instrs if ins.computation == entry and ins.opcode == "parameter"
              for t in ins.types]
    return Facts("xla_gpu_hlo", tuple(sorts), tuple(topks), tuple(attn), tuple(gemms),
                 _stacked(loops, params, num_layers))


# --------------------------------------------------------------------------------- StableHLO
def _signature(line: str) -> tuple[list[Array], list[Array]]:
    """(operand types, result types) of an op's trailing ``: (A, B) -> (C, D)`` type."""
    head, sep, tail = line.rpartition(" : ")
    if not sep:
        return [], []
    ins_text, arrow, outs_text = tail.partition("->")
    if not arrow:  # ``: tensor<...>`` (same type in and out)
        t = _tensors(tail)
        return t, t
    return _tensors(ins_text), _tensors(outs_text)


_CASE = re.compile(r'"stablehlo\.(case|if)"\(')


def _stablehlo_conditional_lines(lines: list[str]) -> list[bool]:
    """Per line: inside a region of a ``stablehlo.case`` / ``if`` with two or more regions,
    or in a function called (transitively) from such a region."""
    ends: dict[int, tuple[int, int]] = {}  # case line -> (end line, regions)
    for i, line in enumerate(lines):
        if _CASE.search(line) and line.rstrip().endswith("({"):
            ind = len(line) - len(line.lstrip())
            regions = 1
            for j in range(i + 1, len(lines)):
                lj = lines[j]
                if len(lj) - len(lj.lstrip()) == ind:
                    if lj.lstrip().startswith("}, {"):
                        regions += 1
                    elif lj.lstrip().startswith("})"):
                        ends[i] = (j, regions)
                        break
    depth = [0] * (len(lines) + 1)
    for i, (j, regions) in ends.items():
        if regions >= 2:
            depth[i + 1] += 1
            depth[j] -= 1
    lexical, d = [], 0
    for i in range(len(lines)):
        d += depth[i]
        lexical.append(d > 0)
    func = ""
    owner: list[str] = []
    calls: dict[str, set[str]] = {}
    roots: set[str] = set()
    for i, line in enumerate(lines):
        fm = re.search(r"func\.func (?:public |private )?@([\w.$\-]+)\(", line)
        if fm:
            func = fm.group(1)
        owner.append(func)
        for cm in re.finditer(r"\bcall @([\w.$\-]+)\(", line):
            calls.setdefault(func, set()).add(cm.group(1))
            if lexical[i]:
                roots.add(cm.group(1))
    cond_funcs = _closure(roots, calls)
    return [lexical[i] or owner[i] in cond_funcs for i in range(len(lines))]


def _read_stablehlo(text: str, vocab: frozenset[int], num_layers: int | None) -> Facts:
    lines = text.splitlines()
    cond = _stablehlo_conditional_lines(lines)
    sorts, topks, attn, gemms, loops = [], [], [], [], []
    params: list[Array] = []
    for i, line in enumerate(lines):
        if "func.func public @main(" in line:
            params = _tensors(line.split("->")[0])
        if "stablehlo.dot_general" in line or re.search(r"stablehlo\.dot\b", line):
            ins, outs = _signature(line)
            if len(ins) >= 2 and outs:
                cm = re.search(r"contracting_dims\s*=\s*\[([^\]]*)\]", line)
                bm = re.search(r"batching_dims\s*=\s*\[([^\]]*)\]", line)
                contracting = _dims(cm.group(1)) if cm else [len(ins[0].shape) - 1]
                gemms.append(_gemm("dot", ins[0], ins[1], outs[0], contracting,
                                   batch=_dims(bm.group(1)) if bm else ()))
        elif "chlo.top_k(" in line:
            km = re.search(r"k\s*=\s*(\d+)", line)
            ins, _ = _signature(line)
            k = int(km.group(1)) if km else 0
            size = ins[0].shape[-1] if ins and ins[0].shape else 0
            topks.append(TopK(k, size, "chlo.top_k"))
            if k > GPU_TOPK_MAX_K and ins:
                sorts.append(Sort(size, ins[0], size in vocab, f"chlo.top_k k={k}", cond[i]))
        elif '"stablehlo.sort"(' in line or "stablehlo.sort " in line:
            dm = re.search(r"dimension\s*=\s*(\d+)", line)
            dim = int(dm.group(1)) if dm else -1
            ins = []
            for nxt in lines[i:]:  # the comparator region closes with ``}) : (types) -> ...``
                if nxt.lstrip().startswith("})") or (nxt is line and " : (" in nxt):
                    ins, _ = _signature(nxt)
                    if ins:
                        break
            if ins:
                a = ins[0]
                size = a.shape[dim] if a.shape else 0
                sorts.append(Sort(size, a, size in vocab, "sort", cond[i]))
        elif "stablehlo.custom_call @" in line:
            target = line.split("stablehlo.custom_call @", 1)[1].split("(", 1)[0]
            ins, outs = _signature(line)
            if target.startswith("__cudnn$fmha"):
                bc = re.search(r'backend_config\s*=\s*"(.*?)"\s*[,}]', line)
                attn.append(_attention(target, ins, outs, bc.group(1) if bc else line))
            elif "topk" in target.lower():
                km = re.search(r"\bk\s*=\s*(\d+)", line)
                k = int(km.group(1)) if km else (outs[0].shape[-1] if outs else 0)
                topks.append(TopK(k, ins[0].shape[-1] if ins and ins[0].shape else 0, target))
        elif "stablehlo.while(" in line:
            loops.extend(_tensors(line.split(") :", 1)[1] if ") :" in line else ""))
    return Facts("cuda_stablehlo", tuple(sorts), tuple(topks), tuple(attn), tuple(gemms),
                 _stacked(loops, params, num_layers))
