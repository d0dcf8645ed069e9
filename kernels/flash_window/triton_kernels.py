"""Triton kernels of flash window attention: O = softmax(scale * Q K^T + B) V per window and head.

A window holds few tokens (49 for 7x7, 144 for 12x12), so the whole L x L score tile stays on chip:
Q, K, V are read once and O written once in the forward; the backward recomputes P on chip.

Tokens are addressed in *image layout*: tensors are viewed as (B, H, W, heads, head_dim) and a
window's token (r, c) is found by undoing the block's cyclic shift and padding in the index
arithmetic, so no roll / pad / partition copies exist around the kernel. The window layout
(B * num_windows, heads, L, head_dim) is the special case of images of one 1 x L window each. A padded token holds
what timm's zero padding gives it after the qkv projection, the qkv bias (the fill): its K and V rows are loaded from
the fill vector's address, and the backward stores its dk and dv rows to a buffer the caller sums into the fill's
gradient.

B is the (heads, L, L) bias (gathered from Swin's relative position table, or given dense) plus the additive mask
of the window's class: Swin's shifted-window mask depends only on whether a window lies in the last row and/or the
last column of its image's window grid, so four (L, L) masks cover it. bias_tiles_kernel adds them into one padded
tile per (class, head) (in the input's half dtype, fp32 for fp32 inputs or with the HALF_BIAS=0 knob); the attention
kernels pick the class from the window's grid position and load its tile (from L2; a forward program whose windows
are all of one class loads it once and keeps it in registers, RESIDENT_BIAS): no per-element region arithmetic, and
a shifted block costs about what an unshifted one does. The backward reads the forward's tiles.

Windows of several query blocks take their keys in two blocks where that pads less than one power-of-two tile
(BLOCK_T > 0): 144 tokens (12x12) as 128 + 16 keys, not 256 (of which 112 would be padding in every product, exp and
bias-tile byte). The softmax spans both blocks; each gets its own k, v, dk, dv and bias-gradient columns.

Swin V2's scaled cosine attention (COSINE): q and k are normalised to unit length on chip and q multiplied by
the head's scale exp(clamped logit scale), read from a (heads,) fp32 vector; the kernels then run with scale 1.
The backward turns the gradients of the normalised q and k into those of the raw ones on chip and sums the scale's
gradient per program (a (programs,) buffer the caller sums), so the normalisation moves no bytes of its own.

Programs take one head and a strided set of windows each (one window each in the forward of several query blocks).
The backward sums the bias gradient of its windows on chip and writes it once per program (a small
(programs, heads, rows, BLOCK_N + BLOCK_T) buffer): bias_grad_sum_kernel sums it over programs and
bias_table_grad_kernel each table entry's token pairs, in a fixed order (no atomics per window and element).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# zero rows after each head's padded-token rows in the fill-gradient buffer (window_attn_bwd_kernel), allocated by
# launch._backward: no size of the buffer is then 0 or 1, on which torch.compile would specialise
SPARE_PAD_ROWS = tl.constexpr(2)


@triton.jit
def _wrap(t, n):
    """t mod n for 0 <= t < 2n (a real token's shifted coordinate), without an integer division."""
    return tl.where(t >= n, t - n, t)


@triton.jit
def _tokens(g, offs, L, H, W, WH: tl.constexpr, WW: tl.constexpr, AGH, AGW, ASH, ASW):
    """Tokens `offs` of global window g: (image b, source row, source column, in-window, real).

    (b, row, column) is the token's pixel in the unshifted, unpadded image; real = in the window and
    not padding."""
    r = offs // WW
    c = offs % WW
    nwa = AGH * AGW
    b = g // nwa
    wa = g - b * nwa
    wy = wa // AGW
    ty = wy * WH + r
    tx = (wa - wy * AGW) * WW + c
    inwin = offs < L
    real = inwin & (ty < H) & (tx < W)
    return b.to(tl.int64), _wrap(ty + ASH, H), _wrap(tx + ASW, W), inwin, real


@triton.jit
def _program(NH, HEAD_MINOR: tl.constexpr):
    """(head, first window, window stride) of this program. HEAD_MINOR: neighbouring programs take the heads of
    one window (neighbouring bytes of its tokens); else the windows of one head."""
    pid = tl.program_id(0)
    nsets = tl.num_programs(0) // NH
    if HEAD_MINOR:
        return pid % NH, pid // NH, nsets
    return pid // nsets, pid % nsets, nsets


@triton.jit
def _mask_class(g, MGH, MGW):
    """0: interior window, 1: last column, 2: last row, 3: both (of the window grid of its image)."""
    w = g % (MGH * MGW)
    wy = w // MGW
    return (wy == MGH - 1).to(tl.int32) * 2 + (w - wy * MGW == MGW - 1).to(tl.int32)


@triton.jit
def _offsets(sy, sx, s_y, s_x, h, s_h, offs_d):
    """(tokens, BLOCK_D) element offsets of head h within one image of a (B, H, W, heads, head_dim) view (int32:
    the image's base is added to the pointer as a scalar)."""
    return (sy * s_y + sx * s_x)[:, None] + h * s_h + offs_d[None, :]


@triton.jit
def _io_mask(real, offs_d, HD):
    """(tokens, BLOCK_D) load/store mask: real tokens, channels below head_dim."""
    return real[:, None] & (offs_d < HD)[None, :]


@triton.jit
def _pad_mask(inwin, real, offs_d, HD):
    """(tokens, BLOCK_D) mask of padded tokens (in the window, not in the image: they hold the fill), channels below
    head_dim."""
    return (inwin & (real == 0))[:, None] & (offs_d < HD)[None, :]


@triton.jit
def _load_tokens(ptr, offsets, io_mask, real, inwin, fill_ptr, offs_d, HD, HAS_FILL: tl.constexpr):
    """(tokens, BLOCK_D) tile; padded image tokens take the fill vector (qkv bias), others 0. The fill is chosen by
    address (one plain load), not by a select on the loaded tile, which was slower (docs/performance.md)."""
    if HAS_FILL:
        pad = _pad_mask(inwin, real, offs_d, HD)
        return tl.load(tl.where(pad, fill_ptr + offs_d[None, :], ptr + offsets), mask=io_mask | pad, other=0.0)
    return tl.load(ptr + offsets, mask=io_mask, other=0.0)


@triton.jit
def _bias_tile(tiles_ptr, cls, h, NH, offs_m, offs_n, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(rows offs_m, columns offs_n) of the (class, head) tile (see bias_tiles_kernel): aligned, padded
    storage, so the load needs no mask and vectorises; the tiles are L2-resident."""
    base = tiles_ptr + (cls * NH + h) * (ROWS * COLS)
    return tl.load(base + offs_m[:, None] * COLS + offs_n[None, :])


@triton.jit
def _relative_entry(offs_m, offs_n, WH, WW):
    """(rows, columns) entries of Swin's relative position table for query tokens offs_m and key tokens offs_n of a
    WH x WW window: (dy + WH - 1) * (2 WW - 1) + dx + WW - 1 for the offset (dy, dx) between them (timm's index)."""
    dy = (offs_m // WW)[:, None] - (offs_n // WW)[None, :]
    dx = (offs_m % WW)[:, None] - (offs_n % WW)[None, :]
    return (dy + WH - 1) * (2 * WW - 1) + dx + WW - 1


@triton.jit
def bias_tiles_kernel(bias_ptr, sb_h, sb_m, sb_n, mask_ptr, tiles_ptr, L, NH, WH, WW, MGH, MGW,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      MASKED: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr):
    """tiles[c, h] = bias[h] + the mask of a class-c window as a (ROWS, COLS) tile (the tiles' dtype, see tile_dtype;
    summed in fp32): -inf in the key columns past L (no key there), 0 in the query rows past L (finite rows: nothing
    of them is stored). TABLE: bias is Swin's relative position table (entries, heads), element (e, h) at
    e * sb_m + h * sb_h, gathered here for a WH x WW window; else the dense (heads, L, L) bias. mask: the (MGH * MGW,
    L, L) mask of a window grid, of which class c (see _mask_class) reads the grid's first window with its last-row
    and last-column flags. Programs: (class, head) x row block x BLOCK_N-wide column block. PDL: the attention
    forward, launched as this kernel's programmatic dependent (Hopper), may start at once (it waits for the tiles
    where it needs them)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    h = pid % NH
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m < L)[:, None] & (offs_n < L)[None, :]
    if TABLE:
        offsets = _relative_entry(offs_m, offs_n, WH, WW) * sb_m
    else:
        offsets = offs_m[:, None] * sb_m + offs_n[None, :] * sb_n
    tile = tl.load(bias_ptr + h * sb_h + offsets, mask=ok, other=0.0).to(tl.float32)
    if MASKED:
        cls = pid // NH
        window = (cls // 2) * (MGH - 1) * MGW + (cls % 2) * (MGW - 1)
        tile += tl.load(mask_ptr + window * L * L + offs_m[:, None] * L + offs_n[None, :], mask=ok, other=0.0)
    tile = tl.where((offs_n < L)[None, :] | (offs_m >= L)[:, None], tile, float("-inf"))
    tl.store(tiles_ptr + pid * (ROWS * COLS) + offs_m[:, None] * COLS + offs_n[None, :],
             tile.to(tiles_ptr.dtype.element_ty))


@triton.jit
def bias_grad_sum_kernel(partial_ptr, out_ptr, SETS, NH, L, ROWS: tl.constexpr, COLS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[h, i, :L] = the sum over the backward programs' (SETS, NH, ROWS, COLS) bias-gradient tiles of row i,
    in a fixed order (deterministic); out is a dense fp32 (NH, L, L). Programs: (head, row)."""
    pid = tl.program_id(0)
    h = pid // L
    i = pid - h * L
    offs_s = tl.arange(0, BLOCK_S)
    offs_n = tl.arange(0, BLOCK_N)
    row = partial_ptr + (h * ROWS + i) * COLS + offs_n[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, SETS, BLOCK_S):
        sets = s + offs_s
        tiles = tl.load(row + sets.to(tl.int64)[:, None] * (NH * ROWS * COLS),
                        mask=(sets < SETS)[:, None] & (offs_n < L)[None, :], other=0.0)
        acc += tl.sum(tiles, 0)
    tl.store(out_ptr + pid * L + offs_n, acc, mask=offs_n < L)


@triton.jit
def bias_table_grad_kernel(dense_ptr, out_ptr, so_e, so_h, L, WH, WW, BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr):
    """The gradient of Swin's relative position table from that of the dense (NH, L, L) fp32 bias: entry (dy, dx)
    sums the pairs of tokens that far apart (deterministic: one program per head and dy sums its entries' pairs in
    a fixed order, no atomics). Programs: head x (2 WH - 1) offsets dy; a program's tile is (query token, dx)."""
    h = tl.program_id(0)
    row = tl.program_id(1)  # dy + WH - 1
    offs_p = tl.arange(0, BLOCK_P)  # the query token (y, x)
    offs_x = tl.arange(0, BLOCK_X)  # dx + WW - 1
    y = offs_p // WW
    yk = y - (row - (WH - 1))
    xk = (offs_p % WW)[:, None] - (offs_x[None, :] - (WW - 1))
    ok = ((offs_p < L) & (yk >= 0) & (yk < WH))[:, None] & (xk >= 0) & (xk < WW) & (offs_x < 2 * WW - 1)[None, :]
    key = yk[:, None] * WW + xk
    grads = tl.load(dense_ptr + (h * L + offs_p[:, None]) * L + key, mask=ok, other=0.0)
    entry = row * (2 * WW - 1) + offs_x
    tl.store(out_ptr + entry * so_e + h * so_h, tl.sum(grads, 0).to(out_ptr.dtype.element_ty),
             mask=offs_x < 2 * WW - 1)


@triton.jit
def _key_value(k_ptr, v_ptr, s_b, s_y, s_x, s_h, b, sy, sx, inwin, real, h, offs_d, HD, fill_ptr, NH,
               HAS_FILL: tl.constexpr):
    """K and V tiles of a window's tokens; padded image tokens take the fill (qkv bias).

    Returns tiles only, never addresses or masks: torch.compile's kernel analysis counts every pointer passed
    to a helper as reaching each of its results, so a store through a result of a helper that took k or v
    would mark them as written (and inductor would copy them)."""
    offs = _offsets(sy, sx, s_y, s_x, h, s_h, offs_d)
    io = _io_mask(real, offs_d, HD)
    k = _load_tokens(k_ptr + b * s_b, offs, io, real, inwin, fill_ptr, offs_d, HD, HAS_FILL)
    v = _load_tokens(v_ptr + b * s_b, offs, io, real, inwin, fill_ptr + NH * HD, offs_d, HD, HAS_FILL)
    return k, v


@triton.jit
def _query_rows(g, mb, offs_n, sy_n, sx_n, real_n, L, H, W, WH: tl.constexpr, WW: tl.constexpr, AGH, AGW, ASH,
                ASW, BLOCK_M: tl.constexpr, NUM_M: tl.constexpr):
    """Query block mb of window g: (token indices, source rows, source columns, real); one block: the keys'."""
    if NUM_M == 1:
        offs_m, sy, sx, real_m = offs_n, sy_n, sx_n, real_n
    else:
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        _b, sy, sx, _inwin, real_m = _tokens(g, offs_m, L, H, W, WH, WW, AGH, AGW, ASH, ASW)
    return offs_m, sy, sx, real_m


@triton.jit
def _unit_rows(x):
    """(x in fp32, 1 / max(|row|, 1e-12)): the rows of F.normalize(x, dim=-1) are x * inv[:, None]."""
    xf = x.to(tl.float32)
    return xf, 1.0 / tl.maximum(tl.sqrt(tl.sum(xf * xf, 1)), 1e-12)


@triton.jit
def _unit_keys(k):
    """(k's rows normalised to unit length, in k's dtype; their inverse norms)."""
    kf, inv = _unit_rows(k)
    return (kf * inv[:, None]).to(k.dtype), inv


@triton.jit
def _unnormalise_grad(dx, xf, inv, scale):
    """Gradient of the raw rows xf from dx, that of scale * xf * inv (F.normalize's rows times scale), and the
    per-row dot products dx . (xf * inv), whose sum is the gradient of scale."""
    unit = xf * inv[:, None]
    dots = tl.sum(unit * dx, 1)
    return (dx - unit * dots[:, None]) * (scale * inv)[:, None], dots


@triton.jit
def _softmax(q, k, bias, scale, PRECISION: tl.constexpr):
    """P = softmax(scale q k^T + bias) in fp32, rows normalised."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + bias
    p = tl.exp2((s - tl.max(s, 1)[:, None]) * 1.4426950408889634)
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def _softmax_split(q, k, k_t, bias, bias_t, scale, PRECISION: tl.constexpr):
    """softmax over the keys of two blocks (the power-of-two head block k and the tail block k_t): (P, P_t)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + bias
    s_t = tl.dot(q, tl.trans(k_t), input_precision=PRECISION) * scale + bias_t
    m = tl.maximum(tl.max(s, 1), tl.max(s_t, 1))[:, None]
    p = tl.exp2((s - m) * 1.4426950408889634)
    p_t = tl.exp2((s_t - m) * 1.4426950408889634)
    inv = (1.0 / (tl.sum(p, 1) + tl.sum(p_t, 1)))[:, None]
    return p * inv, p_t * inv


@triton.jit
def _store_rows(x, ptr, img_off, sy, sx, s_y, s_x, s_h, h, offs_d, HD, g, offs, inwin, real, pad_rows, H, W,
                WH: tl.constexpr, WW: tl.constexpr, AGH, AGW, HAS_FILL: tl.constexpr):
    """Stores a block's gradient rows x: those of its real tokens into the image, those of its padded tokens (they
    hold the fill, the qkv bias) into their slots (_padded_slots) of the (padded tokens, HD) rows at pad_rows, which
    the caller sums into the fill gradient. One store either way: no cross-warp sum, no running sum in registers."""
    ptrs = ptr + img_off + _offsets(sy, sx, s_y, s_x, h, s_h, offs_d)
    mask = _io_mask(real, offs_d, HD)
    if HAS_FILL:
        pad = _pad_mask(inwin, real, offs_d, HD)
        slots = _padded_slots(g, offs, H, W, WH, WW, AGH, AGW)
        ptrs = tl.where(pad, pad_rows + slots[:, None] * HD + offs_d[None, :], ptrs)
        mask = mask | pad
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _padded_slots(g, offs, H, W, WH: tl.constexpr, WW: tl.constexpr, AGH, AGW):
    """Slot of each padded token `offs` of window g among the padded tokens of every image (int64; meaningless for
    real tokens). An (H, W) map pads to a grid of (AGH * WH, AGW * WW) tokens; an image's slots hold its padded rows
    first, then the padded columns of its real rows, so each padded token has a slot of its own and every slot is
    written."""
    nwa = AGH * AGW
    b = g // nwa
    wa = g - b * nwa
    wy = wa // AGW
    ty = wy * WH + offs // WW
    tx = (wa - wy * AGW) * WW + offs % WW
    grid_w = AGW * WW
    pad_h = AGH * WH - H
    pad_w = grid_w - W
    slot = tl.where(ty >= H, (ty - H) * grid_w + tx, pad_h * grid_w + ty * pad_w + (tx - W))
    return b.to(tl.int64) * (pad_h * grid_w + H * pad_w) + slot


@triton.jit
def _key_grad(dk, k_raw, inv_k, scale, COSINE: tl.constexpr):
    """dk times scale; of the raw k with COSINE (inv_k: the keys' inverse norms, else unused)."""
    dk = dk * scale
    if COSINE:
        dk, _dots = _unnormalise_grad(dk, k_raw.to(tl.float32), inv_k, 1.0)
    return dk


@triton.jit
def window_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, s_t, sq_b, sq_y, sq_x, sq_h,
    o_ptr, so_b, so_y, so_x, so_h,
    tiles_ptr, fill_ptr, qs_ptr,
    G, L, H, W, AGH, AGW, ASH, ASW, MGH, MGW, HD, NH, scale,
    WH: tl.constexpr, WW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_M: tl.constexpr, TILE_ROWS: tl.constexpr, MASKED: tl.constexpr, HAS_FILL: tl.constexpr,
    PRECISION: tl.constexpr, STAGES: tl.constexpr, HEAD_MINOR: tl.constexpr, COSINE: tl.constexpr,
    PDL: tl.constexpr, RESIDENT_BIAS: tl.constexpr,
):
    """PDL: launched as a programmatic dependent of bias_tiles_kernel (Hopper): the launch overlaps the tile kernel
    and the programs wait for its tiles here. RESIDENT_BIAS (one query block, one key block, and every window of a
    program of one mask class: the caller checks, see kernels.flash_window.resident_sets): the program loads its
    bias tile once and keeps it in registers instead of once per window from L2."""
    if PDL:
        gdc_wait()
    h, first, nsets = _program(NH, HEAD_MINOR)
    scale = tl.cast(scale, tl.float32)  # inductor types a Python float argument fp64
    if COSINE:
        q_scale = tl.load(qs_ptr + h)
    k_ptr += s_t  # q, k, v of one tensor: s_t apart (separate tensors: s_t = 0)
    v_ptr += 2 * s_t
    fill_ptr += h * HD
    COLS: tl.constexpr = BLOCK_N + BLOCK_T
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_T > 0:  # keys in two blocks: BLOCK_N (a power of two) and the tail (144 = 128 + 16 for 12x12 windows)
        offs_t = BLOCK_N + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    if RESIDENT_BIAS:
        tl.static_assert(NUM_M == 1 and BLOCK_T == 0, "a resident bias tile is one query and one key block")
        resident = _bias_tile(tiles_ptr, _mask_class(first, MGH, MGW) if MASKED else 0, h, NH, offs_n, offs_n,
                              TILE_ROWS, COLS)
    for g in tl.range(first, G, nsets, num_stages=STAGES):
        cls = _mask_class(g, MGH, MGW) if MASKED else 0
        b, sy_n, sx_n, inwin_n, real_n = _tokens(g, offs_n, L, H, W, WH, WW, AGH, AGW, ASH, ASW)
        # the window's image: 64-bit scalar bases, 32-bit offsets within the image
        q_img = q_ptr + b * sq_b
        o_img = o_ptr + b * so_b
        k, v = _key_value(k_ptr, v_ptr, sq_b, sq_y, sq_x, sq_h, b, sy_n, sx_n, inwin_n, real_n, h, offs_d, HD,
                          fill_ptr, NH, HAS_FILL)
        if BLOCK_T > 0:
            _b, sy_t, sx_t, inwin_t, real_t = _tokens(g, offs_t, L, H, W, WH, WW, AGH, AGW, ASH, ASW)
            k_t, v_t = _key_value(k_ptr, v_ptr, sq_b, sq_y, sq_x, sq_h, b, sy_t, sx_t, inwin_t, real_t, h, offs_d,
                                  HD, fill_ptr, NH, HAS_FILL)
        if COSINE:
            k, _inv_k = _unit_keys(k)
            if BLOCK_T > 0:
                k_t, _inv_k_t = _unit_keys(k_t)
        for mb in range(NUM_M):
            offs_m, sy, sx, real_m = _query_rows(g, mb, offs_n, sy_n, sx_n, real_n, L, H, W, WH, WW, AGH, AGW, ASH,
                                                 ASW, BLOCK_M, NUM_M)
            io_m = _io_mask(real_m, offs_d, HD)
            q = tl.load(q_img + _offsets(sy, sx, sq_y, sq_x, h, sq_h, offs_d), mask=io_m, other=0.0)
            if COSINE:
                qf, inv_q = _unit_rows(q)
                q = (qf * (q_scale * inv_q)[:, None]).to(v.dtype)
            if RESIDENT_BIAS:
                bias = resident
            else:
                bias = _bias_tile(tiles_ptr, cls, h, NH, offs_m, offs_n, TILE_ROWS, COLS)
            if BLOCK_T > 0:
                bias_t = _bias_tile(tiles_ptr, cls, h, NH, offs_m, offs_t, TILE_ROWS, COLS)
                p, p_t = _softmax_split(q, k, k_t, bias, bias_t, scale, PRECISION)
                o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                o = tl.dot(p_t.to(v.dtype), v_t, acc=o, input_precision=PRECISION)
            else:
                p = _softmax(q, k, bias, scale, PRECISION)
                o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            tl.store(o_img + _offsets(sy, sx, so_y, so_x, h, so_h, offs_d), o.to(o_ptr.dtype.element_ty), mask=io_m)


@triton.jit
def window_attn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, s_t, sq_b, sq_y, sq_x, sq_h,
    do_ptr, sdo_b, sdo_y, sdo_x, sdo_h,
    dqkv_ptr, sd_t, sdq_b, sdq_y, sdq_x, sdq_h,
    tiles_ptr, fill_ptr, dbias_ptr, dpad_ptr, qs_ptr, dqs_ptr,
    G, L, H, W, AGH, AGW, ASH, ASW, MGH, MGW, HD, NH, scale,
    WH: tl.constexpr, WW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_M: tl.constexpr, TILE_ROWS: tl.constexpr, MASKED: tl.constexpr, HAS_FILL: tl.constexpr,
    PRECISION: tl.constexpr, STAGES: tl.constexpr, HEAD_MINOR: tl.constexpr, COSINE: tl.constexpr,
):
    """Every window's bias tile comes from L2: kept in registers across windows (as the forward does), the
    registers it holds make this kernel slower."""
    h, first, nsets = _program(NH, HEAD_MINOR)
    scale = tl.cast(scale, tl.float32)  # inductor types a Python float argument fp64
    if COSINE:
        q_scale = tl.load(qs_ptr + h)
        dq_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)  # row sums of the scale's gradient
    k_ptr += s_t  # q, k, v of one tensor: s_t apart (separate tensors: s_t = 0)
    v_ptr += 2 * s_t
    fill_ptr += h * HD
    # dq, dk, dv are one tensor, sd_t apart: a single written argument, so that torch.compile hands
    # the kernel its buffer as is (written views of one buffer make inductor copy and scatter them)
    dq_ptr = dqkv_ptr
    dk_ptr = dqkv_ptr + sd_t
    dv_ptr = dqkv_ptr + 2 * sd_t
    COLS: tl.constexpr = BLOCK_N + BLOCK_T
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_T > 0:  # keys in two blocks: BLOCK_N (a power of two) and the tail (144 = 128 + 16 for 12x12 windows)
        offs_t = BLOCK_N + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    # this program's (rows, COLS) slice of the bias-gradient buffer
    dbias_base = dbias_ptr + (first * NH + h).to(tl.int64) * (NUM_M * BLOCK_M * COLS)
    if NUM_M == 1:
        dbias_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the padded tokens' dk and dv rows (see _store_rows): (2, NH, padded tokens + SPARE_PAD_ROWS, HD), k's then
    # v's; each head's first program zeroes the spare rows
    padded_tokens = (G // (AGH * AGW)) * (AGH * WH * AGW * WW - H * W)
    pad_k = dpad_ptr + (h * (padded_tokens + SPARE_PAD_ROWS) * HD).to(tl.int64)
    pad_v = pad_k + (NH * (padded_tokens + SPARE_PAD_ROWS) * HD).to(tl.int64)
    if HAS_FILL and first == 0:
        offs_spare = tl.arange(0, SPARE_PAD_ROWS * BLOCK_D)
        spare = tl.zeros((SPARE_PAD_ROWS * BLOCK_D,), dtype=pad_k.dtype.element_ty)
        tl.store(pad_k + padded_tokens * HD + offs_spare, spare, mask=offs_spare < HD * SPARE_PAD_ROWS)
        tl.store(pad_v + padded_tokens * HD + offs_spare, spare, mask=offs_spare < HD * SPARE_PAD_ROWS)
    for g in tl.range(first, G, nsets, num_stages=STAGES):
        cls = _mask_class(g, MGH, MGW) if MASKED else 0
        b, sy_n, sx_n, inwin_n, real_n = _tokens(g, offs_n, L, H, W, WH, WW, AGH, AGW, ASH, ASW)
        # the window's image: 64-bit scalar bases, 32-bit offsets within the image
        q_img = q_ptr + b * sq_b
        do_img = do_ptr + b * sdo_b
        dq_img = dq_ptr + b * sdq_b
        k, v = _key_value(k_ptr, v_ptr, sq_b, sq_y, sq_x, sq_h, b, sy_n, sx_n, inwin_n, real_n, h, offs_d, HD,
                          fill_ptr, NH, HAS_FILL)
        if BLOCK_T > 0:
            _b, sy_t, sx_t, inwin_t, real_t = _tokens(g, offs_t, L, H, W, WH, WW, AGH, AGW, ASH, ASW)
            k_t, v_t = _key_value(k_ptr, v_ptr, sq_b, sq_y, sq_x, sq_h, b, sy_t, sx_t, inwin_t, real_t, h, offs_d,
                                  HD, fill_ptr, NH, HAS_FILL)
            dk_t = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            dv_t = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        if COSINE:
            k_raw = k
            k, inv_k = _unit_keys(k)
            if BLOCK_T > 0:
                k_raw_t = k_t
                k_t, inv_k_t = _unit_keys(k_t)
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        if NUM_M > 1:
            dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for mb in range(NUM_M):
            offs_m, sy, sx, real_m = _query_rows(g, mb, offs_n, sy_n, sx_n, real_n, L, H, W, WH, WW, AGH, AGW, ASH,
                                                 ASW, BLOCK_M, NUM_M)
            io_m = _io_mask(real_m, offs_d, HD)
            q = tl.load(q_img + _offsets(sy, sx, sq_y, sq_x, h, sq_h, offs_d), mask=io_m, other=0.0)
            if COSINE:
                qf, inv_q = _unit_rows(q)
                q = (qf * (q_scale * inv_q)[:, None]).to(v.dtype)
            do = tl.load(do_img + _offsets(sy, sx, sdo_y, sdo_x, h, sdo_h, offs_d), mask=io_m, other=0.0)
            bias = _bias_tile(tiles_ptr, cls, h, NH, offs_m, offs_n, TILE_ROWS, COLS)
            if NUM_M > 1:  # the program's running bias-gradient rows, loaded early to hide the latency; only the
                # real (L, L) part: past it ds is 0, and the padded columns would be 44% of a 144-token tile
                dbias_ptrs = dbias_base + offs_m[:, None] * COLS + offs_n[None, :]
                dbias_mask = (offs_m[:, None] < L) & (offs_n[None, :] < L)
                dbias_rows = tl.load(dbias_ptrs, mask=dbias_mask, other=0.0)
            if BLOCK_T > 0:
                bias_t = _bias_tile(tiles_ptr, cls, h, NH, offs_m, offs_t, TILE_ROWS, COLS)
                dbias_ptrs_t = dbias_base + offs_m[:, None] * COLS + offs_t[None, :]
                dbias_mask_t = (offs_m[:, None] < L) & (offs_t[None, :] < L)
                dbias_rows_t = tl.load(dbias_ptrs_t, mask=dbias_mask_t, other=0.0)
                p, p_t = _softmax_split(q, k, k_t, bias, bias_t, scale, PRECISION)
                dv_t += tl.dot(tl.trans(p_t.to(do.dtype)), do, input_precision=PRECISION)
                dp_t = tl.dot(do, tl.trans(v_t), input_precision=PRECISION)
            else:
                p = _softmax(q, k, bias, scale, PRECISION)
            if NUM_M == 1:  # one query block: dv is whole here; stored at once, it is not live beside
                # p, dp and the bias-gradient sum
                _store_rows(tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION), dv_ptr, b * sdq_b,
                            sy_n, sx_n, sdq_y, sdq_x, sdq_h, h, offs_d, HD, g, offs_n, inwin_n, real_n, pad_v, H, W,
                            WH, WW, AGH, AGW, HAS_FILL)
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            delta = tl.sum(p * dp, 1)
            if BLOCK_T > 0:
                delta += tl.sum(p_t * dp_t, 1)
            ds = p * (dp - delta[:, None])  # gradient of the scores (= of the bias tile)
            dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            if BLOCK_T > 0:
                ds_t = p_t * (dp_t - delta[:, None])
                dq = tl.dot(ds_t.to(k.dtype), k_t, acc=dq, input_precision=PRECISION)
                dk_t += tl.dot(tl.trans(ds_t.to(q.dtype)), q, input_precision=PRECISION)
            dq = dq * scale
            if COSINE:
                dq, dots = _unnormalise_grad(dq, qf, inv_q, q_scale)
                dq_scale += dots
            tl.store(dq_img + _offsets(sy, sx, sdq_y, sdq_x, h, sdq_h, offs_d), dq.to(dq_ptr.dtype.element_ty),
                     mask=io_m)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
            if NUM_M == 1:
                dbias_acc += ds
            else:  # the program owns its slice: plain read-add-write, no atomics
                tl.store(dbias_ptrs, dbias_rows + ds, mask=dbias_mask)
                if BLOCK_T > 0:
                    tl.store(dbias_ptrs_t, dbias_rows_t + ds_t, mask=dbias_mask_t)
                # the next window's load may give an element to another thread than the one that stored it (the
                # load's and the sum's layouts differ): a CTA barrier makes every store visible to the whole block
                tl.debug_barrier()
        img_off = b * sdq_b
        dk = _key_grad(dk, k_raw if COSINE else k, inv_k if COSINE else scale, scale, COSINE)
        _store_rows(dk, dk_ptr, img_off, sy_n, sx_n, sdq_y, sdq_x, sdq_h, h, offs_d, HD, g, offs_n, inwin_n, real_n,
                    pad_k, H, W, WH, WW, AGH, AGW, HAS_FILL)
        if NUM_M > 1:
            _store_rows(dv, dv_ptr, img_off, sy_n, sx_n, sdq_y, sdq_x, sdq_h, h, offs_d, HD, g, offs_n, inwin_n,
                        real_n, pad_v, H, W, WH, WW, AGH, AGW, HAS_FILL)
        if BLOCK_T > 0:
            dk_t = _key_grad(dk_t, k_raw_t if COSINE else k_t, inv_k_t if COSINE else scale, scale, COSINE)
            _store_rows(dk_t, dk_ptr, img_off, sy_t, sx_t, sdq_y, sdq_x, sdq_h, h, offs_d, HD, g, offs_t, inwin_t,
                        real_t, pad_k, H, W, WH, WW, AGH, AGW, HAS_FILL)
            _store_rows(dv_t, dv_ptr, img_off, sy_t, sx_t, sdq_y, sdq_x, sdq_h, h, offs_d, HD, g, offs_t, inwin_t,
                        real_t, pad_v, H, W, WH, WW, AGH, AGW, HAS_FILL)
    if NUM_M == 1:
        tl.store(dbias_base + offs_n[:, None] * COLS + offs_n[None, :], dbias_acc)
    if COSINE:
        tl.store(dqs_ptr + first * NH + h, tl.sum(dq_scale, 0))
