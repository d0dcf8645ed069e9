"""Triton kernels of flash window attention: O = softmax(scale * Q K^T + B + M) V per window and head.

A window holds few tokens (49 for 7x7, 144 for 12x12), so the whole L x L score tile stays on chip:
Q, K, V are read once and O written once in the forward; the backward recomputes P on chip.

Tokens are addressed in *image layout*: tensors are viewed as (B, H, W, heads, head_dim) and a
window's token (r, c) is found by undoing the block's cyclic shift and padding in the index
arithmetic, so no roll / pad / partition copies exist around the kernel. The window layout
(B * num_windows, heads, L, head_dim) is the special case of images of one window each.

Two geometries per launch:
* addressing: feature size (H, W), windows per image (AGH, AGW), cyclic shift (ASH, ASW);
* mask: windows per image (MGH, MGW) and shift (MSH, MSW) of the *padded, shifted* image the
  shifted-window regions are computed on (official Swin: 3 x 3 regions, -100 across regions).
In image layout both are the same image; in window layout the addressing images are single windows.

Each program takes one head and a strided set of windows. The relative position bias tile is loaded
once per program; its gradient is summed over the program's windows on chip and written once per
program (a small (programs, heads, L, L) buffer, reduced into the table by the caller): no atomics
per window and element.
"""
import triton
import triton.language as tl


@triton.jit
def _wrap(t, n):
    """t mod n for 0 <= t < 2n (a real token's shifted coordinate), without an integer division."""
    return tl.where(t >= n, t - n, t)


@triton.jit
def _token_geometry(g, offs, L, H, W, WH: tl.constexpr, WW: tl.constexpr,
                    AGH, AGW, ASH, ASW, MGH, MGW, MSH, MSW):
    """Tokens `offs` of global window g: (image b, source row, source column, in-window, real, region).

    (b, row, column) is the token's pixel in the unshifted, unpadded image; real = in the window and
    not padding; region = the shifted-window region (official Swin's 3 x 3 slices) for the mask.
    """
    r = offs // WW
    c = offs % WW
    # addressing: padded-shifted coordinates -> source pixel of the unshifted, unpadded image
    nwa = AGH * AGW
    b = (g // nwa).to(tl.int64)
    wa = g % nwa
    ty = (wa // AGW) * WH + r
    tx = (wa % AGW) * WW + c
    inwin = offs < L
    real = inwin & (ty < H) & (tx < W)
    sy = _wrap(ty + ASH, H)
    sx = _wrap(tx + ASW, W)
    # shifted-window regions on the padded, shifted image (timm's slices of the padded size)
    nwm = MGH * MGW
    wm = g % nwm
    my = (wm // MGW) * WH + r
    mx = (wm % MGW) * WW + c
    hp = MGH * WH
    wp = MGW * WW
    reg_y = tl.where(MSH > 0, (my >= hp - WH).to(tl.int32) + (my >= hp - MSH).to(tl.int32), 0)
    reg_x = tl.where(MSW > 0, (mx >= wp - WW).to(tl.int32) + (mx >= wp - MSW).to(tl.int32), 0)
    return b, sy, sx, inwin, real, reg_y * 3 + reg_x


@triton.jit
def _offsets(b, sy, sx, s_b, s_y, s_x, h, s_h, offs_d):
    """(tokens, BLOCK_D) element offsets of head h in a (B, H, W, heads, head_dim) view."""
    return (b * s_b + sy * s_y + sx * s_x)[:, None] + h * s_h + offs_d[None, :]


@triton.jit
def _window_tiles(b, sy, sx, inwin, real, q_ptr, k_ptr, v_ptr, s_b, s_y, s_x, h, s_h,
                  do_ptr, sdo_b, sdo_y, sdo_x, sdo_h, offs_d, HD, fill_ptr, NH,
                  HAS_FILL: tl.constexpr, LOAD_Q: tl.constexpr, LOAD_DO: tl.constexpr):
    """K, V (and Q, dO if asked) tiles of the tokens (b, sy, sx); nothing is loaded for tokens that are
    not `inwin` (a prefetch past the last window passes all false).

    Returns tiles only, never geometry: torch.compile's kernel analysis counts every pointer passed to
    a helper as reaching each of the helper's results, so a store address computed from a result of a
    helper that also took q/k/v would mark q/k/v as written (and inductor would copy them)."""
    offs_qkv = _offsets(b, sy, sx, s_b, s_y, s_x, h, s_h, offs_d)
    io_mask = _io_mask(real, offs_d, HD)
    k = _load_tokens(k_ptr, offs_qkv, io_mask, real, inwin, h, offs_d, HD, fill_ptr, HAS_FILL)
    v = _load_tokens(v_ptr, offs_qkv, io_mask, real, inwin, h, offs_d, HD, fill_ptr + NH * HD, HAS_FILL)
    q = k
    do = k
    if LOAD_Q:
        q = tl.load(q_ptr + offs_qkv, mask=io_mask, other=0.0)
    if LOAD_DO:
        do = tl.load(do_ptr + _offsets(b, sy, sx, sdo_b, sdo_y, sdo_x, h, sdo_h, offs_d), mask=io_mask, other=0.0)
    return k, v, q, do


@triton.jit
def _io_mask(real, offs_d, HD):
    """(tokens, BLOCK_D) load/store mask: real tokens, channels below head_dim."""
    return real[:, None] & (offs_d < HD)[None, :]


@triton.jit
def _load_tokens(ptr, offsets, io_mask, real, inwin, h, offs_d, HD, fill_ptr, HAS_FILL: tl.constexpr):
    """(tokens, BLOCK_D) tile; padded image tokens take the fill vector (qkv bias), others 0."""
    x = tl.load(ptr + offsets, mask=io_mask, other=0.0)
    if HAS_FILL:
        fill = tl.load(fill_ptr + h * HD + offs_d, mask=offs_d < HD, other=0.0).to(x.dtype)
        x = tl.where((inwin & (real == 0))[:, None], fill[None, :], x)
    return x


@triton.jit
def _scores(q, k, bias, reg_m, reg_n, n_ok, scale, SHIFTED: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + bias
    if SHIFTED:
        s = s + tl.where(reg_m[:, None] != reg_n[None, :], -100.0, 0.0)
    return tl.where(n_ok[None, :], s, float("-inf"))


@triton.jit
def _bias_tile(table_ptr, h, NH, offs_m, offs_n, L, WH: tl.constexpr, WW: tl.constexpr):
    """Relative position bias (BLOCK_M, BLOCK_N) gathered from the contiguous (T, heads) table."""
    idx = ((offs_m // WW)[:, None] - (offs_n // WW)[None, :] + WH - 1) * (2 * WW - 1) \
        + ((offs_m % WW)[:, None] - (offs_n % WW)[None, :] + WW - 1)
    ok = (offs_m < L)[:, None] & (offs_n < L)[None, :]
    return tl.load(table_ptr + idx * NH + h, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def window_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, s_t, sq_b, sq_y, sq_x, sq_h,
    o_ptr, so_b, so_y, so_x, so_h,
    table_ptr, fill_ptr,
    G, L, H, W, AGH, AGW, ASH, ASW, MGH, MGW, MSH, MSW, HD, NH, scale,
    WH: tl.constexpr, WW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_M: tl.constexpr,
    SHIFTED: tl.constexpr, HAS_FILL: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    nprog = tl.num_programs(0)
    scale = tl.cast(scale, tl.float32)  # inductor types a Python float argument fp64
    k_ptr += s_t  # q, k, v of one tensor: s_t apart (separate tensors: s_t = 0)
    v_ptr += 2 * s_t
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    ONE_BLOCK: tl.constexpr = NUM_M == 1
    if ONE_BLOCK:  # one query block: bias tile loaded once for all of the program's windows
        bias0 = _bias_tile(table_ptr, h, NH, offs_n, offs_n, L, WH, WW)
    if PREFETCH:  # the next window's tiles are loaded while this one is computed (latency hiding)
        b, sy_n, sx_n, inwin_n, real_n, _reg = _token_geometry(pid, offs_n, L, H, W, WH, WW, AGH, AGW, ASH, ASW,
                                                               MGH, MGW, MSH, MSW)
        k_next, v_next, q_next, _do = _window_tiles(
            b, sy_n, sx_n, inwin_n & (pid < G), real_n & (pid < G), q_ptr, k_ptr, v_ptr, sq_b, sq_y, sq_x, h, sq_h,
            q_ptr, 0, 0, 0, 0, offs_d, HD, fill_ptr, NH, HAS_FILL, ONE_BLOCK, False)
    for g in tl.range(pid, G, nprog, num_stages=STAGES):
        b, sy_n, sx_n, inwin_n, real_n, reg_n = _token_geometry(g, offs_n, L, H, W, WH, WW, AGH, AGW, ASH, ASW,
                                                                MGH, MGW, MSH, MSW)
        if PREFETCH:
            k, v, q_n = k_next, v_next, q_next
            g_next = g + nprog
            b_x, sy_x, sx_x, inwin_x, real_x, _reg = _token_geometry(g_next, offs_n, L, H, W, WH, WW, AGH, AGW,
                                                                     ASH, ASW, MGH, MGW, MSH, MSW)
            k_next, v_next, q_next, _do = _window_tiles(
                b_x, sy_x, sx_x, inwin_x & (g_next < G), real_x & (g_next < G), q_ptr, k_ptr, v_ptr,
                sq_b, sq_y, sq_x, h, sq_h, q_ptr, 0, 0, 0, 0, offs_d, HD, fill_ptr, NH, HAS_FILL, ONE_BLOCK, False)
        else:
            k, v, q_n, _do = _window_tiles(b, sy_n, sx_n, inwin_n, real_n, q_ptr, k_ptr, v_ptr, sq_b, sq_y, sq_x,
                                           h, sq_h, q_ptr, 0, 0, 0, 0, offs_d, HD, fill_ptr, NH, HAS_FILL, ONE_BLOCK,
                                           False)
        for mb in range(NUM_M):
            if ONE_BLOCK:
                sy, sx, real_m, reg_m, q, bias = sy_n, sx_n, real_n, reg_n, q_n, bias0
            else:
                offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
                _b_m, sy, sx, _inwin_m, real_m, reg_m = _token_geometry(g, offs_m, L, H, W, WH, WW, AGH, AGW, ASH, ASW,
                                                                        MGH, MGW, MSH, MSW)
                q = tl.load(q_ptr + _offsets(b, sy, sx, sq_b, sq_y, sq_x, h, sq_h, offs_d),
                            mask=_io_mask(real_m, offs_d, HD), other=0.0)
                bias = _bias_tile(table_ptr, h, NH, offs_m, offs_n, L, WH, WW)
            s = _scores(q, k, bias, reg_m, reg_n, inwin_n, scale, SHIFTED, PRECISION)
            m = tl.max(s, 1)
            p = tl.exp2((s - m[:, None]) * 1.4426950408889634)
            denom = tl.sum(p, 1)
            o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION) / denom[:, None]
            tl.store(o_ptr + _offsets(b, sy, sx, so_b, so_y, so_x, h, so_h, offs_d), o.to(o_ptr.dtype.element_ty),
                     mask=_io_mask(real_m, offs_d, HD))


@triton.jit
def window_attn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, s_t, sq_b, sq_y, sq_x, sq_h,
    do_ptr, sdo_b, sdo_y, sdo_x, sdo_h,
    dqkv_ptr, sd_t, sdq_b, sdq_y, sdq_x, sdq_h,
    table_ptr, fill_ptr, dbias_ptr, dfill_ptr,
    G, L, H, W, AGH, AGW, ASH, ASW, MGH, MGW, MSH, MSW, HD, NH, scale,
    WH: tl.constexpr, WW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_M: tl.constexpr,
    SHIFTED: tl.constexpr, HAS_FILL: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    nprog = tl.num_programs(0)
    scale = tl.cast(scale, tl.float32)  # inductor types a Python float argument fp64
    k_ptr += s_t  # q, k, v of one tensor: s_t apart (separate tensors: s_t = 0)
    v_ptr += 2 * s_t
    # dq, dk, dv are one tensor, sd_t apart: a single written argument, so that torch.compile hands
    # the kernel its buffer as is (written views of one buffer make inductor copy and scatter them)
    dq_ptr = dqkv_ptr
    dk_ptr = dqkv_ptr + sd_t
    dv_ptr = dqkv_ptr + 2 * sd_t
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HD
    ONE_BLOCK: tl.constexpr = NUM_M == 1
    # this program's slice of the (programs, heads, L, L) bias-gradient buffer
    dbias_base = dbias_ptr + (pid * NH + h).to(tl.int64) * L * L
    if ONE_BLOCK:
        bias0 = _bias_tile(table_ptr, h, NH, offs_n, offs_n, L, WH, WW)
        dbias_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dfill_k = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dfill_v = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for g in tl.range(pid, G, nprog, num_stages=STAGES):
        b, sy_n, sx_n, inwin_n, real_n, reg_n = _token_geometry(g, offs_n, L, H, W, WH, WW, AGH, AGW, ASH, ASW,
                                                                MGH, MGW, MSH, MSW)
        k, v, q_n, do_n = _window_tiles(b, sy_n, sx_n, inwin_n, real_n, q_ptr, k_ptr, v_ptr, sq_b, sq_y, sq_x, h, sq_h,
                                        do_ptr, sdo_b, sdo_y, sdo_x, sdo_h, offs_d, HD, fill_ptr, NH,
                                        HAS_FILL, ONE_BLOCK, ONE_BLOCK)
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for mb in range(NUM_M):
            offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            if ONE_BLOCK:
                sy, sx, real_m, reg_m, q, do, bias = sy_n, sx_n, real_n, reg_n, q_n, do_n, bias0
            else:
                _b_m, sy, sx, _inwin_m, real_m, reg_m = _token_geometry(g, offs_m, L, H, W, WH, WW, AGH, AGW, ASH, ASW,
                                                                        MGH, MGW, MSH, MSW)
                io_mask_m = _io_mask(real_m, offs_d, HD)
                q = tl.load(q_ptr + _offsets(b, sy, sx, sq_b, sq_y, sq_x, h, sq_h, offs_d), mask=io_mask_m, other=0.0)
                do = tl.load(do_ptr + _offsets(b, sy, sx, sdo_b, sdo_y, sdo_x, h, sdo_h, offs_d),
                             mask=io_mask_m, other=0.0)
                bias = _bias_tile(table_ptr, h, NH, offs_m, offs_n, L, WH, WW)
            s = _scores(q, k, bias, reg_m, reg_n, inwin_n, scale, SHIFTED, PRECISION)
            m = tl.max(s, 1)
            p = tl.exp2((s - m[:, None]) * 1.4426950408889634)
            p = p / tl.sum(p, 1)[:, None]
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - tl.sum(p * dp, 1)[:, None])  # gradient of the scores (= of bias + mask)
            dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * scale
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
            tl.store(dq_ptr + _offsets(b, sy, sx, sdq_b, sdq_y, sdq_x, h, sdq_h, offs_d),
                     dq.to(dq_ptr.dtype.element_ty), mask=_io_mask(real_m, offs_d, HD))
            if ONE_BLOCK:
                dbias_acc += ds
            else:  # the program owns its slice: plain read-add-write, no atomics
                ptrs = dbias_base + offs_m[:, None] * L + offs_n[None, :]
                ok = (offs_m < L)[:, None] & (offs_n < L)[None, :]
                tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + ds, mask=ok)
        dk = dk * scale
        kv_offs = _offsets(b, sy_n, sx_n, sdq_b, sdq_y, sdq_x, h, sdq_h, offs_d)
        kv_mask = _io_mask(real_n, offs_d, HD)
        tl.store(dk_ptr + kv_offs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
        if HAS_FILL:  # padded tokens hold the qkv bias: their k/v gradients flow to it
            pad = (inwin_n & (real_n == 0))[:, None]
            dfill_k += tl.sum(tl.where(pad, dk, 0.0), 0)
            dfill_v += tl.sum(tl.where(pad, dv, 0.0), 0)
    if ONE_BLOCK:
        ok = (offs_n < L)[:, None] & (offs_n < L)[None, :]
        tl.store(dbias_base + offs_n[:, None] * L + offs_n[None, :], dbias_acc, mask=ok)
    if HAS_FILL:
        tl.atomic_add(dfill_ptr + h * HD + offs_d, dfill_k, mask=dmask)
        tl.atomic_add(dfill_ptr + (NH + h) * HD + offs_d, dfill_v, mask=dmask)
