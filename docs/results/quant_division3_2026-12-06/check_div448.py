"""Exhaustive check (all fp32 significands, two binades; the computation is scale-invariant in the normal range):
Markstein's division by 448 with the constant reciprocal R = RN(1/448), as fp8.triton_blocks.scale_from_amax_tl does
it (q = RN(a·R); r = a − 448·q (exact, one fma); RN(q + r·R), one fma), equals RN(a / 448) for every a."""
import numpy as np

R = np.float32(1) / np.float32(448)
for e in (0, 1):
    m = np.arange(1 << 23, 1 << 24, dtype=np.int64)  # significands of a in [2^e, 2^(e+1))
    a = (m.astype(np.float64) * 2.0 ** (e - 23)).astype(np.float32)
    a64 = a.astype(np.float64)
    # reference: RN32(a / 448) by integer division with round-half-even
    k = np.where(m < 14680064, 9, 8)  # m·2^k/448 = m·2^(k-6)/7 lands in [2^23, 2^24) before rounding
    num = m << k
    Q, Rem = num // 448, num % 448
    assert np.all((Q >= 1 << 23) & (Q < 1 << 24))
    Q = Q + ((2 * Rem > 448) | ((2 * Rem == 448) & (Q % 2 == 1)))  # round half to even (Q may reach 2^24: exact)
    scale = np.exp2((e - 23 - k).astype(np.float64))
    want = (Q.astype(np.float64) * scale).astype(np.float32)
    assert np.all(want.astype(np.float64) == Q.astype(np.float64) * scale)
    # Markstein in exact arithmetic
    q = (a64 * np.float64(R)).astype(np.float32)  # a·R exact in float64, one rounding to fp32
    res64 = a64 - 448.0 * q.astype(np.float64)  # exact (Sterbenz)
    res = res64.astype(np.float32)
    assert np.all(res.astype(np.float64) == res64), "residual not representable"
    p = res64 * np.float64(R)  # exact (48 bits)
    s = p + q.astype(np.float64)  # TwoSum: s + err == p + q exactly
    bb = s - q.astype(np.float64)
    err = (q.astype(np.float64) - (s - bb)) + (p - bb)
    f = s.astype(np.float32)
    lo = np.where(f.astype(np.float64) > s, np.nextafter(f, np.float32(-np.inf)), f)
    hi = np.where(f.astype(np.float64) > s, f, np.nextafter(f, np.float32(np.inf)))
    mid = (s - lo.astype(np.float64)) == (hi.astype(np.float64) - s)
    got = np.where(mid & (err > 0), hi, np.where(mid & (err < 0), lo, f))
    bad = got.view(np.int32) != want.view(np.int32)
    print(f"binade 2^{e}: {m.size} values, {int(mid.sum())} float64 midpoints resolved, {int(bad.sum())} differ")
    assert not bad.any()
