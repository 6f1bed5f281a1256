"""Lane-level numpy emulation of attention_prefill_kernel<D, KG> (csrc/kernels/attention_prefill.cu):
the PTX fragment semantics of ldmatrix (.trans) and mma.m16n8k16, driven by the kernel's own index
expressions (loaders, fragment addresses, masks, online softmax, the key groups' merge), against a
float64 reference. It checks the mapping without a GPU, not the timing, the cp.async pipeline or the
barriers. Slow (pure Python per lane): a few small shapes.

    python tools/emulate_attention_prefill.py
"""
# The closures below are called inside the iteration that defines them (as the kernel's lambdas are).
# ruff: noqa: B023

import ml_dtypes
import numpy as np

BF = ml_dtypes.bfloat16


def bf(x):
    return np.asarray(x, np.float32).astype(BF).astype(np.float64)


def ldsm_x4(smem, addrs, trans=False):
    # addrs[lane] = element index of a 16-byte row; returns regs[lane][4] as pairs (lo, hi)
    regs = np.zeros((32, 4, 2))
    for i in range(4):
        mat = np.stack([smem[addrs[8 * i + r] : addrs[8 * i + r] + 8] for r in range(8)])  # [8 rows, 8 cols]
        if trans:
            mat = mat.T
        for t in range(32):
            regs[t, i] = mat[t // 4, 2 * (t % 4) : 2 * (t % 4) + 2]
    return regs


def mma(d, a, b0, b1):
    # d[32][4], a[32][4][2], b0/b1[32][2]
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for t in range(32):
        g, c = t // 4, t % 4
        A[g, 2 * c : 2 * c + 2] = a[t, 0]
        A[g + 8, 2 * c : 2 * c + 2] = a[t, 1]
        A[g, 2 * c + 8 : 2 * c + 10] = a[t, 2]
        A[g + 8, 2 * c + 8 : 2 * c + 10] = a[t, 3]
        B[2 * c : 2 * c + 2, g] = b0[t]
        B[2 * c + 8 : 2 * c + 10, g] = b1[t]
    Cm = A @ B
    for t in range(32):
        g, c = t // 4, t % 4
        d[t, 0] += Cm[g, 2 * c]
        d[t, 1] += Cm[g, 2 * c + 1]
        d[t, 2] += Cm[g + 8, 2 * c]
        d[t, 3] += Cm[g + 8, 2 * c + 1]


def run(q, kc, vc, pos, M, H, Hkv, D, KG, scale, cap):
    S = D + 8
    KS = D // 16
    NT = 8
    CH = D // 8
    G = H // Hkv
    rows = M * G
    tiles = -(-rows // 64)
    out = np.full((M, H, D), np.nan)
    qs = scale * 1.4426950408889634
    for bx in range(tiles):
        for h in range(Hkv):
            p0 = (tiles - 1 - bx) * 64
            pos_c = min(max(pos, 0), cap - M)
            p_last = min(p0 + 64, rows) - 1
            n_keys = pos_c + p_last // G + 1
            n_kt = -(-n_keys // 64)
            kQ = 64 * S
            kTile = 64 * S
            kGroup = 4 * kTile
            smem = np.full(kQ + KG * kGroup, np.nan)
            for i in range(64 * CH):
                r, ch = i // CH, i % CH
                p = p0 + r
                ok = p < rows
                m = p // G if ok else 0
                gh = p % G if ok else 0
                smem[r * S + ch * 8 : r * S + ch * 8 + 8] = q[m, h * G + gh, ch * 8 : ch * 8 + 8] if ok else 0

            def load_kv(grp, kt, st):
                base = kQ + grp * kGroup + st * 2 * kTile
                for i in range(64 * CH):
                    r, ch = i // CH, i % CH
                    key = kt * 64 + r
                    ok = key < n_keys
                    smem[base + r * S + ch * 8 : base + r * S + ch * 8 + 8] = kc[key, h, ch * 8 : ch * 8 + 8] if ok else 0
                    smem[base + kTile + r * S + ch * 8 : base + kTile + r * S + ch * 8 + 8] = (
                        vc[key, h, ch * 8 : ch * 8 + 8] if ok else 0
                    )

            st_all = {}
            for grp in range(KG):
                for wq in range(4):
                    lanes = np.arange(32)
                    g = lanes // 4
                    c = lanes % 4
                    qf = [
                        ldsm_x4(smem, [(wq * 16 + l % 16) * S + ks * 16 + (l // 16) * 8 for l in range(32)]) for ks in range(KS)
                    ]
                    limit = lambda r: pos_c + min(p0 + r, rows - 1) // G
                    lim0 = np.array([limit(wq * 16 + gg) for gg in g])
                    lim1 = np.array([limit(wq * 16 + gg + 8) for gg in g])
                    warp_lo, warp_hi = limit(wq * 16), limit(wq * 16 + 15)
                    o = np.zeros((2 * KS, 32, 4))
                    m_run = np.full((32, 2), -1e30)
                    l_run = np.zeros((32, 2))
                    kt = grp
                    it = 0
                    while kt < n_kt:
                        st = it & 1
                        load_kv(grp, kt, st)  # (the pipeline's order is not modelled: tile kt present when read)
                        kb = kt * 64
                        if kb <= warp_hi:
                            sk = kQ + grp * kGroup + st * 2 * kTile
                            sv = sk + kTile
                            s = np.zeros((NT, 32, 4))
                            for ks in range(KS):
                                for nb in range(NT // 2):
                                    b = ldsm_x4(
                                        smem,
                                        [
                                            sk + (nb * 16 + (l // 16) * 8 + l % 8) * S + ks * 16 + ((l // 8) % 2) * 8
                                            for l in range(32)
                                        ],
                                    )
                                    mma(s[2 * nb], qf[ks], b[:, 0], b[:, 1])
                                    mma(s[2 * nb + 1], qf[ks], b[:, 2], b[:, 3])
                            masked = kb + 63 > warp_lo
                            for j in range(NT):
                                for e in range(4):
                                    v = s[j, :, e] * qs
                                    key = kb + 8 * j + 2 * c + (e & 1)
                                    lim = lim0 if e < 2 else lim1
                                    if masked:
                                        v = np.where(key > lim, -np.inf, v)
                                    s[j, :, e] = v
                            mx = m_run.copy()
                            for j in range(NT):
                                mx[:, 0] = np.maximum(mx[:, 0], np.maximum(s[j, :, 0], s[j, :, 1]))
                                mx[:, 1] = np.maximum(mx[:, 1], np.maximum(s[j, :, 2], s[j, :, 3]))
                            for i in range(2):
                                mq = mx[:, i].reshape(8, 4).max(1).repeat(4)
                                mx[:, i] = mq
                                corr = np.exp2(m_run[:, i] - mx[:, i])
                                m_run[:, i] = mx[:, i]
                                l_run[:, i] *= corr
                                o[:, :, 2 * i] *= corr
                                o[:, :, 2 * i + 1] *= corr
                            for kk in range(NT // 2):
                                a = np.zeros((32, 4, 2))
                                P = lambda j, e, i: bf(np.exp2(s[j, :, e] - m_run[:, i]))
                                a[:, 0] = np.stack([P(2 * kk, 0, 0), P(2 * kk, 1, 0)], 1)
                                a[:, 1] = np.stack([P(2 * kk, 2, 1), P(2 * kk, 3, 1)], 1)
                                a[:, 2] = np.stack([P(2 * kk + 1, 0, 0), P(2 * kk + 1, 1, 0)], 1)
                                a[:, 3] = np.stack([P(2 * kk + 1, 2, 1), P(2 * kk + 1, 3, 1)], 1)
                                l_run[:, 0] += a[:, 0].sum(1) + a[:, 2].sum(1)
                                l_run[:, 1] += a[:, 1].sum(1) + a[:, 3].sum(1)
                                for dn in range(KS):
                                    b = ldsm_x4(
                                        smem,
                                        [
                                            sv + (kk * 16 + ((l // 8) % 2) * 8 + l % 8) * S + dn * 16 + (l // 16) * 8
                                            for l in range(32)
                                        ],
                                        trans=True,
                                    )
                                    mma(o[2 * dn], a, b[:, 0], b[:, 1])
                                    mma(o[2 * dn + 1], a, b[:, 2], b[:, 3])
                        kt += KG
                        it += 1
                    for i in range(2):
                        l_run[:, i] = l_run[:, i].reshape(8, 4).sum(1).repeat(4)
                    st_all[(grp, wq)] = (o, m_run, l_run)
            for wq in range(4):
                o, m_run, l_run = st_all[(0, wq)]
                if KG == 2:
                    o1, m1, l1 = st_all[(1, wq)]
                    mx = np.maximum(m_run, m1)
                    f0 = np.exp2(m_run - mx)
                    f1 = np.exp2(m1 - mx)
                    l_run = l_run * f0 + l1 * f1
                    o = o * np.repeat(f0, 2, axis=1)[None] + o1 * np.repeat(f1, 2, axis=1)[None]
                for t in range(32):
                    g, c = t // 4, t % 4
                    for i in range(2):
                        p = p0 + wq * 16 + g + 8 * i
                        if p >= rows:
                            continue
                        m, gh = p // G, p % G
                        for j in range(2 * KS):
                            out[m, h * G + gh, 8 * j + 2 * c] = o[j, t, 2 * i] / l_run[t, i]
                            out[m, h * G + gh, 8 * j + 2 * c + 1] = o[j, t, 2 * i + 1] / l_run[t, i]
    return bf(out)


def ref(q, kc, vc, pos, M, H, Hkv, D, scale):
    G = H // Hkv
    out = np.empty((M, H, D))
    for m in range(M):
        n = pos + m + 1
        for h in range(Hkv):
            s = q[m, h * G : (h + 1) * G] @ kc[:n, h].T * scale
            p = np.exp(s - s.max(1, keepdims=True))
            out[m, h * G : (h + 1) * G] = (p / p.sum(1, keepdims=True)) @ vc[:n, h]
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    for M, pos, Hkv, G, D, KG in [
        (1, 0, 1, 1, 64, 1),
        (5, 3, 2, 3, 64, 2),
        (17, 1, 1, 7, 64, 1),
        (30, 100, 2, 3, 128, 2),
        (9, 60, 1, 16, 64, 2),
        (70, 90, 1, 3, 80, 1),
        (3, 200, 1, 4, 96, 2),
        (40, 0, 1, 2, 64, 1),
    ]:
        H = Hkv * G
        C = pos + M + 3
        kc = bf(rng.standard_normal((C, Hkv, D)))
        vc = bf(rng.standard_normal((C, Hkv, D)))
        q = bf(rng.standard_normal((M, H, D)) * 2)
        kc[pos + M :] = np.nan
        vc[pos + M :] = np.nan
        sc = 1 / np.sqrt(D)
        got = run(q, kc, vc, pos, M, H, Hkv, D, KG, sc, C)
        want = ref(q, kc, vc, pos, M, H, Hkv, D, sc)
        err = np.linalg.norm(got - want, axis=2) / np.linalg.norm(want, axis=2)
        print(f"M={M} pos={pos} Hkv={Hkv} G={G} D={D} KG={KG}: max row rel-L2 {err.max():.2e}")
        assert np.isfinite(got).all() and err.max() < 8e-3


if __name__ == "__main__":
    main()
