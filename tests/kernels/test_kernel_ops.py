"""The native kernels take torch tensors and check them in C++ (csrc/cpu/tensor_arg.h): a wrong shape,
dtype, layout or device is a ValueError naming the op and the argument, raised before any pointer
reaches a kernel, for the direct entry points, the layer stack and the torch ops
(torch.ops.minisgl.*) alike; and the model's code hands the kernels tensors, never raw pointers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from minisgl_backend.model import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="minisgl_backend.native._kernels not built, disabled, or this CPU lacks AVX2",
)

native = cpu_kernels._native
MODEL_DIR = Path(cpu_kernels.__file__).parent


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).bfloat16()


def _linear_args() -> dict:
    return {
        "x": _bf16(2, 64),
        "weight": _bf16(16, 64),
        "bias": _bf16(16),
        "out": torch.empty(2, 16).bfloat16(),
    }


def _attention_args() -> dict:
    return {
        "q": _bf16(3, 4, 16),
        "k_pool": _bf16(8, 4, 2, 16),
        "v_pool": _bf16(8, 4, 2, 16),
        "tables": torch.arange(6).view(3, 2),
        "row_table": torch.arange(3),
        "positions": torch.tensor([1, 5, 7]),
        "out": torch.empty(3, 4, 16).bfloat16(),
    }


def _norm_args() -> dict:
    x = _bf16(3, 32)
    return {"x": x, "residual": None, "sum_out": None, "weight": _bf16(32), "out": torch.empty_like(x)}


def _run(op: str, args: dict) -> None:
    tail = {
        "linear_bf16": (2, cpu_kernels.isa()),
        "paged_attention": (0.25, 0.0, 0, 0, 2, cpu_kernels.isa()),
        "rms_norm": (1e-6, False, 2, cpu_kernels.isa()),
    }[op]
    getattr(native, op)(*args.values(), *tail)


CASES = {"linear_bf16": _linear_args, "paged_attention": _attention_args, "rms_norm": _norm_args}


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """t's values at the same shape, every other element of a twice-as-wide buffer along the last dim."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("op", CASES)
def test_the_checked_ops_run_on_good_arguments(op):
    """The baseline the error cases below depart from, one argument at a time."""
    _run(op, CASES[op]())


@pytest.mark.parametrize(
    "op,arg,bad,message",
    [
        (
            "linear_bf16",
            "weight",
            _bf16(16, 63),
            r"'weight' must be shape \[\*, 64\], got shape \[16, 63\]|'x' must be",
        ),
        (
            "linear_bf16",
            "out",
            torch.empty(2, 15).bfloat16(),
            r"'out' must be shape \[2, 16\], got shape \[2, 15\]",
        ),
        ("linear_bf16", "bias", _bf16(17), r"'bias' must be shape \[16\], got shape \[17\]"),
        ("paged_attention", "k_pool", _bf16(8, 4, 2, 8), r"'k_pool' must be shape \[\*, \*, \*, 16\]"),
        (
            "paged_attention",
            "positions",
            torch.tensor([1, 5]),
            r"'positions' must be shape \[3\], got shape \[2\]",
        ),
        ("rms_norm", "weight", _bf16(31), r"'weight' must be shape \[32\], got shape \[31\]"),
        ("rms_norm", "out", torch.empty(3, 16).bfloat16(), r"'out' must be shape \[3, 32\] \(as 'x'\)"),
    ],
)
def test_a_wrong_shape_is_a_clear_error(op, arg, bad, message):
    args = CASES[op]() | {arg: bad}
    with pytest.raises(ValueError, match=rf"minisgl\.{op}: argument {message}"):
        _run(op, args)


@pytest.mark.parametrize(
    "op,arg,dtype,message",
    [
        ("linear_bf16", "weight", torch.float32, "'weight' must be dtype bfloat16, got dtype float32"),
        ("linear_bf16", "x", torch.float16, "'x' must be dtype bfloat16, got dtype float16"),
        ("paged_attention", "tables", torch.int32, "'tables' must be dtype int64, got dtype int32"),
        (
            "paged_attention",
            "v_pool",
            torch.float32,
            r"'v_pool' must be dtype bfloat16 \(as 'q'\), got dtype float32",
        ),
        (
            "rms_norm",
            "weight",
            torch.float32,
            r"'weight' must be dtype bfloat16 \(as 'x'\), got dtype float32",
        ),
    ],
)
def test_a_wrong_dtype_is_a_clear_error(op, arg, dtype, message):
    args = CASES[op]()
    args[arg] = args[arg].to(dtype)
    with pytest.raises(ValueError, match=rf"minisgl\.{op}: argument {message}"):
        _run(op, args)


@pytest.mark.parametrize(
    "op,arg",
    [("linear_bf16", "weight"), ("linear_bf16", "out"), ("paged_attention", "k_pool"), ("rms_norm", "x")],
)
def test_a_noncontiguous_tensor_is_a_clear_error(op, arg):
    args = CASES[op]()
    args[arg] = _noncontiguous(args[arg])
    with pytest.raises(
        ValueError, match=rf"minisgl\.{op}: argument '{arg}' must be a contiguous tensor, got .*strides"
    ):
        _run(op, args)


def test_paged_attention_takes_query_rows_at_a_stride():
    """q may be a view into a fused qkv output (rows apart, heads packed): the kernel walks it by its
    row stride and gives the contiguous copy's bits; a gap between heads is an error."""
    args = _attention_args()
    expect = torch.empty_like(args["out"])
    _run("paged_attention", args | {"out": expect})
    wide = torch.zeros(3, 6, 16).bfloat16()
    wide[:, 1:5] = args["q"]
    _run("paged_attention", args | {"q": wide[:, 1:5]})
    assert torch.equal(args["out"], expect)
    with pytest.raises(ValueError, match=r"'q' must be its heads packed in a row"):
        _run("paged_attention", args | {"q": torch.zeros(3, 4, 32).bfloat16()[:, :, :16]})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_write_puts_each_row_in_its_slot_and_checks_them(dtype):
    """The K/V write copies row i of k and v (views into a fused qkv output, rows apart) into slot
    slots[i] of each pool, as torch's index_copy_ does, and leaves every other slot alone; a gap
    between a row's heads, a slot outside the pool or a pool of another dtype is a clear error
    before anything is written."""
    h, kvh, d, n = 4, 2, 16, 5
    qkv = torch.randn(n, h + 2 * kvh, d).to(dtype)
    k, v = qkv[:, h : h + kvh], qkv[:, h + kvh :]
    pools = [torch.randn(6, 4, kvh, d).to(dtype) for _ in range(2)]
    expect = [p.clone() for p in pools]
    slots = torch.tensor([9, 2, 23, 0, 14])
    expect[0].view(-1, kvh, d).index_copy_(0, slots, k)
    expect[1].view(-1, kvh, d).index_copy_(0, slots, v)
    assert cpu_kernels.kv_write(pools[0], pools[1], slots, k, v)
    assert torch.equal(pools[0], expect[0]) and torch.equal(pools[1], expect[1])
    with pytest.raises(IndexError, match=r"minisgl\.kv_write: slot 24 out of range for a pool of 24 slots"):
        native.kv_write(k, v, *pools, torch.tensor([0, 1, 2, 3, 24]), 2)
    gapped = torch.zeros(n, kvh, 2 * d).to(dtype)[:, :, :d]
    gap = r"minisgl\.kv_write: argument 'k' must be rows of kv_heads x head_dim"
    with pytest.raises(ValueError, match=gap):
        native.kv_write(gapped, gapped, *pools, slots, 2)
    with pytest.raises(ValueError, match=r"argument 'v_pool' must be dtype"):
        native.kv_write(k, v, pools[0], pools[1].to(torch.float16), slots, 2)
    assert torch.equal(pools[0], expect[0]) and torch.equal(pools[1], expect[1])


@pytest.mark.parametrize("op,arg", [("linear_bf16", "x"), ("paged_attention", "q"), ("rms_norm", "weight")])
def test_a_tensor_on_another_device_is_a_clear_error(op, arg):
    args = CASES[op]()
    args[arg] = torch.empty(args[arg].shape, dtype=args[arg].dtype, device="meta")
    with pytest.raises(
        ValueError, match=rf"minisgl\.{op}: argument '{arg}' must be a CPU tensor, got Tensor on meta"
    ):
        _run(op, args)


def test_a_missing_tensor_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"minisgl\.linear_bf16: argument 'weight' must be a tensor, got None"
    ):
        _run("linear_bf16", _linear_args() | {"weight": None})
    with pytest.raises(ValueError, match=r"argument 'x' must be a CPU tensor, got int"):
        _run("linear_bf16", _linear_args() | {"x": 7})


def _stack(hidden=32, heads=2, kv_heads=1, head_dim=16, inter=48, blocks=8, block=4):
    stack = native.LayerStack(
        heads, kv_heads, head_dim, hidden, inter, 1e-6, 0.25, 0.0, block, blocks, 0, 0, cpu_kernels.isa(), 1
    )
    lin = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    linears = {
        name: native.StackLinear(_bf16(n, k), None, None, None, None, n, k) for name, (n, k) in lin.items()
    }
    pool = (blocks, block, kv_heads, head_dim)
    layer = dict(
        input_norm=_bf16(hidden),
        post_norm=_bf16(hidden),
        q_norm=None,
        k_norm=None,
        kpool=torch.zeros(pool).bfloat16(),
        vpool=torch.zeros(pool).bfloat16(),
        window=0,
        rope=0,
        gated=False,
    )
    return stack, linears, layer


def _stack_run_args(rows=2, hidden=32, rot=16) -> dict:
    return dict(
        x=_bf16(rows, hidden),
        mlp_out=torch.empty(rows, hidden).bfloat16(),
        positions=torch.tensor([0, 1][:rows]),
        slots=torch.tensor([0, 1][:rows]),
        tables=torch.zeros(rows, 1, dtype=torch.int64),
        row_table=torch.arange(rows),
        keep=None,
        cos=[_bf16(rows, rot)],
        sin=[_bf16(rows, rot)],
        threads=2,
    )


def test_the_layer_stack_checks_its_layers():
    stack, linears, layer = _stack()
    stack.add_layer(**linears, **layer)  # the good layer
    with pytest.raises(
        ValueError, match=r"LayerStack\.add_layer: linear 'o' must be shape \[32, 32\], got shape \[32, 16\]"
    ):
        stack.add_layer(
            **(linears | {"o": native.StackLinear(_bf16(32, 16), None, None, None, None, 32, 16)}), **layer
        )
    with pytest.raises(
        ValueError, match=r"LayerStack\.add_layer: argument 'kpool' must be shape \[8, 4, 1, 16\]"
    ):
        stack.add_layer(**linears, **(layer | {"kpool": torch.zeros(8, 4, 2, 16).bfloat16()}))
    with pytest.raises(ValueError, match=r"argument 'input_norm' must be dtype bfloat16, got dtype float32"):
        stack.add_layer(**linears, **(layer | {"input_norm": torch.ones(32)}))
    with pytest.raises(
        ValueError, match=r"StackLinear: argument 'weight' must be shape \[48, 32\], got shape \[32, 48\]"
    ):
        native.StackLinear(_bf16(32, 48), None, None, None, None, 48, 32)
    with pytest.raises(
        ValueError, match=r"StackLinear: argument 'qweight' must be given exactly when 'qscale' is"
    ):
        native.StackLinear(_bf16(48, 32), None, None, torch.zeros(48, 32, dtype=torch.int8), None, 48, 32)


def test_the_layer_stack_checks_its_batch():
    stack, linears, layer = _stack()
    stack.add_layer(**linears, **layer)
    stack.run(**_stack_run_args())  # the good batch
    bad = {
        "positions": (
            torch.tensor([0, 1], dtype=torch.int32),
            r"'positions' must be dtype int64, got dtype int32",
        ),
        "x": (_bf16(2, 31), r"'x' must be shape \[\*, 32\], got shape \[2, 31\]"),
        "mlp_out": (torch.empty(3, 32).bfloat16(), r"'mlp_out' must be shape \[2, 32\]"),
        "tables": (
            _noncontiguous(torch.zeros(2, 2, dtype=torch.int64)),
            "'tables' must be a contiguous tensor",
        ),
        "cos": ([_bf16(2, 18)], r"'cos' must be an even rotary width of at most the head dim, got 18"),
        "slots": (torch.empty(2, dtype=torch.int64, device="meta"), "'slots' must be a CPU tensor"),
        "row_table": (torch.arange(3), r"'row_table' must be shape \[2\], got shape \[3\]"),
        "keep": (torch.tensor([[0]]), r"'keep' must be shape \[\*\], got shape \[1, 1\]"),
    }
    for arg, (value, message) in bad.items():
        with pytest.raises(ValueError, match=rf"minisgl\.LayerStack\.run: argument {message}"):
            stack.run(**(_stack_run_args() | {arg: value}))
    # a row's table or a kept row outside the batch: an IndexError before any kernel runs
    with pytest.raises(IndexError, match="table, position or block id"):
        stack.run(**(_stack_run_args() | {"row_table": torch.tensor([0, 2])}))
    with pytest.raises(IndexError, match="kept row"):
        stack.run(**(_stack_run_args() | {"keep": torch.tensor([2])}))


def test_the_layer_stack_keeps_its_tensors_alive():
    """The native stack holds a reference to every tensor it reads, and lets go with the stack."""
    stack, linears, layer = _stack()
    pool = layer["kpool"]
    if not hasattr(pool, "_use_count"):
        pytest.skip("this torch does not count a tensor's references")
    before = pool._use_count()
    stack.add_layer(**linears, **layer)
    assert pool._use_count() == before + 1
    del stack
    assert pool._use_count() == before


def test_the_torch_ops_are_the_checked_kernels():
    """torch.ops.minisgl.<op> runs the same checked native function: the wrapper's bits, and the same
    clear error for a bad argument."""
    args = _norm_args()
    expect = cpu_kernels.rms_norm(args["x"], args["weight"], 1e-6, False)
    assert expect is not None
    torch.ops.minisgl.rms_norm(*args.values(), 1e-6, False, 2, cpu_kernels.isa())
    assert torch.equal(args["out"], expect[0])
    assert "Tensor(b!) out" in str(torch.ops.minisgl.rms_norm.default._schema)
    assert set(cpu_kernels.OP_SCHEMAS) <= set(dir(native))
    with pytest.raises(ValueError, match=r"minisgl\.linear_bf16: argument 'weight' must be dtype bfloat16"):
        a = _linear_args()
        torch.ops.minisgl.linear_bf16(a["x"], a["weight"].float(), a["bias"], a["out"], 2, cpu_kernels.isa())


def test_torch_compile_traces_through_the_ops():
    """The ops' schemas (which tensors each writes) let torch.compile trace a graph around them
    (fullgraph: no break at the op) that gives the eager bits."""
    x, weight = _bf16(3, 32), _bf16(32)

    def norm_twice(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.minisgl.rms_norm(x, None, None, weight, out, 1e-6, False, 1, cpu_kernels.isa())
        return out * 2

    compiled = torch.compile(norm_twice, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, weight), norm_twice(x, weight))


# The one place in the model that reads a data pointer: a storage's identity, to count each storage's
# bytes once (never handed to a kernel).
ALLOWED_DATA_PTR = {("llama.py", "held_bytes")}


def _data_ptr_calls() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(MODEL_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr == "data_ptr":
                    found.add((path.name, fn.name))
    return found


def test_the_model_hands_the_kernels_tensors_not_pointers():
    assert _data_ptr_calls() <= ALLOWED_DATA_PTR
    assert "data_ptr" not in (MODEL_DIR / "cpu_kernels.py").read_text()
    assert "data_ptr" not in (MODEL_DIR / "layer_stack.py").read_text()
