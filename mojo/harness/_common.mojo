"""Shared harness helpers: device random fill, tensor views, error and timing helpers.

The harness instantiates every op's `execute["gpu"]` outside MAX: built with
`mojo build --target-accelerator sm_90|gfx942` it compiles all GPU kernels; run on a GPU it checks
them against float64 references computed here on the host and times them.
"""

from max.gpu import global_idx, grid_dim, block_dim
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer, DeviceAttribute
from std.time import perf_counter_ns
from std.math import sqrt


def _mix(x: UInt64) -> UInt64:
    """Return splitmix64's finalizer: a cheap, well-mixed hash of the element index."""
    var z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


def _fill_kernel[dtype: DType](p: Pointer[Scalar[dtype], MutAnyOrigin], n: Int64, seed: Int64, lo: Float64, hi: Float64):
    var i = global_idx.x
    var stride = grid_dim.x * block_dim.x
    while i < Int(n):
        var u = Float64(_mix(UInt64(i) ^ (UInt64(seed) << 40)) >> 11) * (1.0 / 9007199254740992.0)
        var v = lo + (hi - lo) * u
        comptime if dtype.is_integral():
            p[unsafe_offset=i] = Scalar[dtype](Int(v) if v >= 0 else -Int(-v))
        else:
            p[unsafe_offset=i] = v.cast[dtype]()
        i += stride


def fill_random[dtype: DType](ctx: DeviceContext, buf: DeviceBuffer[dtype], n: Int, seed: Int, lo: Float64, hi: Float64) raises:
    """Fill buf[0:n] with uniform [lo, hi) values (fresh per seed), on the device."""
    ctx.enqueue_function[_fill_kernel[dtype]](buf, Int64(n), Int64(seed), lo, hi, grid_dim=4096, block_dim=256)


def poison[dtype: DType](ctx: DeviceContext, buf: DeviceBuffer[dtype]) raises:
    """Overwrite an output with NaN (floats) or a sentinel (ints) so unwritten elements show."""
    comptime if dtype.is_integral():
        buf.enqueue_fill(Scalar[dtype](-7777777))
    else:
        buf.enqueue_fill(Scalar[dtype](Float64.MAX * 0.0 + FloatLiteral.nan))


def to_host[dtype: DType](ctx: DeviceContext, buf: DeviceBuffer[dtype], n: Int) raises -> HostBuffer[dtype]:
    var h = ctx.enqueue_create_host_buffer[dtype](n)
    ctx.enqueue_copy(h, buf)
    ctx.synchronize()
    return h


struct RelErr(Copyable, Movable):
    """Accumulates ||got - ref|| / ||ref|| in float64 (NaN-propagating)."""

    var num: Float64
    var den: Float64
    var bad: Int

    def __init__(out self):
        self.num = 0
        self.den = 0
        self.bad = 0

    def add(mut self, got: Float64, want: Float64):
        if got != got:
            self.bad += 1
        self.num += (got - want) * (got - want)
        self.den += want * want

    def add_pattern(mut self, got: Float64, want: Float64):
        """Like add, for references that may be non-finite: a NaN must stay NaN, +-inf the same inf
        (else counted bad); only finite references enter the error."""
        if want != want:
            if got == got:
                self.bad += 1
            return
        if want * 0 != 0:  # +-inf
            if got != want:
                self.bad += 1
            return
        self.add(got, want)

    def value(self) -> Float64:
        if self.bad > 0:
            return Float64.MAX_FINITE  # (Float64.MAX is +inf)
        if self.den == 0:
            return sqrt(self.num)
        return sqrt(self.num / self.den)


def check(name: String, err: Float64, tol: Float64, mut failures: Int):
    var ok = err <= tol
    if not ok:
        failures += 1
    print("CHECK", "ok  " if ok else "FAIL", name, "rel_err=", err, "tol=", tol)


def tol_for[dtype: DType]() -> Float64:
    """Output-rounding tolerance: a few ulps of the output dtype at 1.0."""
    comptime if dtype == DType.bfloat16:
        return 8e-3
    elif dtype == DType.float16:
        return 2e-3
    elif dtype.is_integral():
        return 0.0
    else:
        return 2e-5


def _mut[dtype: DType, o: Origin](p: Pointer[Scalar[dtype], o]) -> Pointer[Scalar[dtype], MutAnyOrigin]:
    """Forget a buffer pointer's origin (the launchers take MutAnyOrigin pointers, as execute gets)."""
    return rebind[Pointer[Scalar[dtype], MutAnyOrigin]](p)


def now_ns() -> Int:
    return Int(perf_counter_ns())


def report_bw(name: String, bytes: Int, ns_per_iter: Float64):
    var gbs = Float64(bytes) / ns_per_iter
    print("PERF", name, "us=", ns_per_iter / 1000.0, "GB/s=", gbs, "of_copy_4283=", gbs / 4283.0)


def device_params(ctx: DeviceContext, *vals: Float32) raises -> DeviceBuffer[DType.float32]:
    """The op's `params` f32 tensor on the device."""
    var h = ctx.enqueue_create_host_buffer[DType.float32](len(vals))
    ctx.synchronize()
    for i in range(len(vals)):
        h[i] = vals[i]
    var d = ctx.enqueue_create_buffer[DType.float32](len(vals))
    ctx.enqueue_copy(d, h)
    ctx.synchronize()
    return d


def sample_rows(m: Int, i: Int, count: Int) -> Int:
    """The i-th of `count` rows spread over [0, m) (all rows when m <= count)."""
    if m <= count:
        return i
    return (i * (m - 1)) // (count - 1)


def sm_count(ctx: DeviceContext) raises -> Int:
    """The device's SM (CU) count, which the kernels size their grids (and so their workspaces) from."""
    return ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)


def workspace[dtype: DType](ctx: DeviceContext, n: Int) raises -> DeviceBuffer[dtype]:
    """A caller-owned op workspace of max(n, 1) elements (the Python side allocates these with torch)."""
    return ctx.enqueue_create_buffer[dtype](max(n, 1))
