"""fusekit.mojo_occupancy: the residency arithmetic on synthetic PTX and ptxas logs (no GPU, no ptxas)."""

from fusekit.mojo_occupancy import parse

PTX = ".visible .entry k_rope(\n.maxntid 256, 1, 1\n{\n}\n"
LOG = "ptxas info    : Used {regs} registers, used 0 barriers, {smem} bytes smem\n    0 bytes stack frame, {spill} bytes spill stores, 0 bytes spill loads\n"


def _use(regs: int, smem: int = 0, spill: int = 0, ptx: str = PTX):
    use = parse(ptx, LOG.format(regs=regs, smem=smem, spill=spill))
    assert use is not None
    return use


def test_registers_set_the_resident_blocks() -> None:
    # 256 threads: 8 warps; 128 registers -> 8 * 4096 = 32 K registers per block, 2 blocks per SM
    assert _use(128).blocks_per_sm == 2 and _use(128).threads_per_sm == 512
    # 154 registers round up to 160 per thread (256 per warp): 40 K per block, one block per SM (rope at b5f625f)
    assert _use(154).blocks_per_sm == 1
    assert _use(64).blocks_per_sm == 4 and _use(32).threads_per_sm == 2048  # the thread limit


def test_static_shared_memory_and_declarations() -> None:
    assert _use(32, smem=100 * 1024).blocks_per_sm == 2  # 228 KB per SM, 1 KB reserved per block
    use = _use(40, spill=8, ptx=PTX.replace("{", ".minnctapersm 2\n{", 1))
    assert use.min_blocks == 2 and use.spill_bytes == 8 and use.name == "k_rope" and use.threads == 256
    assert parse(PTX, "no ptxas output") is None
