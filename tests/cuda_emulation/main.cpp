// The CUDA kernels of src/model/ops/cuda, run on the CPU through emulate.h and compared with
// plain double-precision computations written here: forward values against the formulas, and
// every backward against central finite differences of the double forward (an independent
// check of the gradient formulas, not a second copy of them). Each kernel runs in f32, bf16
// and f16, with blocks of 32 (one warp), 128 and 256 threads (what the host launches: 128 for the
// cached attention, 256 for the rest) and shapes that are not multiples of a block.
//
// Built and run by tests/integration/cuda_kernels_emulated.rs; exits 1 when a check fails.
#include <array>
#include <cstdio>
#include <functional>
#include <string>

#include "../../src/model/ops/cuda/adamw.cu"
#include "../../src/model/ops/cuda/add.cu"
#include "../../src/model/ops/cuda/cached_attention.cu"
#include "../../src/model/ops/cuda/embedding.cu"
#include "../../src/model/ops/cuda/flash_attention.cu"
#include "../../src/model/ops/cuda/logprob_lse.cu"
#include "../../src/model/ops/cuda/rms_norm.cu"
#include "../../src/model/ops/cuda/rope.cu"
#include "../../src/model/ops/cuda/sample_rows.cu"
#include "../../src/model/ops/cuda/softmax.cu"
#include "../../src/model/ops/cuda/swiglu.cu"
#include "../../src/model/ops/cuda/transpose.cu"

using Vec = std::vector<double>;
using Fn = std::function<double(const Vec&)>;

static int checks = 0, failures = 0;

static Vec values(size_t n, uint64_t seed, double scale) {
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    Vec out(n);
    for (auto& x : out) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = ((double)(s >> 11) / (double)(1ull << 53) * 2.0 - 1.0) * scale;
    }
    return out;
}

template <typename T> static double to_double(T x) { return (double)to_f32(x); }
template <typename T> static std::vector<T> cast(const Vec& x) {
    std::vector<T> out;
    for (double v : x) out.push_back(from_f32<T>((float)v));
    return out;
}
template <typename T> static Vec widen(const std::vector<T>& x) {
    Vec out;
    for (T v : x) out.push_back(to_double(v));
    return out;
}
// x as the kernel sees it: rounded to T.
template <typename T> static Vec rounded(const Vec& x) { return widen(cast<T>(x)); }

static void expect(const std::string& what, const Vec& got, const Vec& want, double tol) {
    ++checks;
    double worst = 0.0;
    size_t at = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double e = std::fabs(got[i] - want[i]) / (1.0 + std::fabs(want[i]));
        if (!(e <= worst)) worst = e, at = i;  // NaN counts as the worst
    }
    const bool ok = got.size() == want.size() && worst <= tol;
    if (!ok) ++failures;
    std::printf("%s %s: max relative error %.2e (at %zu, tolerance %.0e)\n", ok ? "ok  " : "FAIL", what.c_str(),
                worst, at, tol);
}

// d f / d x by central differences.
static Vec numeric_grad(const Fn& f, Vec x) {
    Vec g(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        const double h = 1e-5 * (1.0 + std::fabs(x[i])), keep = x[i];
        x[i] = keep + h;
        const double up = f(x);
        x[i] = keep - h;
        const double down = f(x);
        x[i] = keep;
        g[i] = (up - down) / (2 * h);
    }
    return g;
}

static double dot(const Vec& a, const Vec& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

template <typename T> struct Kernels;
#define KERNELS(T, sfx)                                                         \
    template <> struct Kernels<T> {                                             \
        static constexpr const char* name = #sfx;                               \
        static constexpr auto rms_norm = rms_norm_##sfx;                        \
        static constexpr auto rms_norm_bwd_rows = rms_norm_bwd_rows_##sfx;      \
        static constexpr auto dw_partial = rms_norm_bwd_dw_partial_##sfx;       \
        static constexpr auto dw_sum = rms_norm_bwd_dw_sum_##sfx;               \
        static constexpr auto swiglu = swiglu_##sfx;                            \
        static constexpr auto swiglu_bwd = swiglu_bwd_##sfx;                    \
        static constexpr auto rope = rope_##sfx;                                \
        static constexpr auto rope_pair = rope_pair_##sfx;                      \
        static constexpr auto add_rms_norm = add_rms_norm_##sfx;                \
        static constexpr auto logprob_lse = logprob_lse_##sfx;                  \
        static constexpr auto logprob_lse_bwd = logprob_lse_bwd_##sfx;          \
        static constexpr auto masked_softmax = masked_softmax_##sfx;            \
        static constexpr auto masked_softmax_bwd = masked_softmax_bwd_##sfx;    \
        static constexpr auto cached_attention = cached_attention_##sfx;        \
        static constexpr auto sample_rows = sample_rows_##sfx;                  \
        static constexpr auto sum_squares = sum_squares_##sfx;                  \
        static constexpr auto softmax_mixed = masked_softmax_mixed_##sfx;       \
        static constexpr auto softmax_bwd_mixed = masked_softmax_bwd_mixed_##sfx; \
        static constexpr auto lse_mixed = logprob_lse_mixed_##sfx;              \
        static constexpr auto lse_bwd_mixed = logprob_lse_bwd_mixed_##sfx;      \
        static constexpr auto transpose = transpose_##sfx;                      \
        static constexpr auto swap_heads = swap_heads_##sfx;                    \
        static constexpr auto round_into = round_into_##sfx;                    \
        static constexpr auto embedding_grad = embedding_grad_##sfx;            \
        static constexpr auto widen = widen_##sfx;                              \
        static constexpr auto bias_add = bias_add_##sfx;                        \
        static constexpr auto add = add_##sfx;                                  \
    };
KERNELS(float, f32)
KERNELS(bf16, bf16)
KERNELS(f16, f16)

template <typename T> static double tolerance() { return std::is_same<T, float>::value ? 2e-5 : 1.5e-2; }
template <typename T> static std::string label(const char* what, unsigned block) {
    return std::string(what) + " " + Kernels<T>::name + " block " + std::to_string(block);
}

template <typename T> static void rms_norm(unsigned block) {
    const long long n = 5;
    for (long long d : {70ll, 300ll}) {
        const float eps = 1e-6f;
        const Vec x = rounded<T>(values(n * d, 1, 3.0)), w = rounded<T>(values(d, 2, 1.0)),
                  gy = rounded<T>(values(n * d, 3, 1.0));
        auto fwd = [&](const Vec& x, const Vec& w) {
            Vec y(n * d);
            for (long long i = 0; i < n; ++i) {
                double ss = 0;
                for (long long j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
                const double r = 1.0 / std::sqrt(ss / d + eps);
                for (long long j = 0; j < d; ++j) y[i * d + j] = x[i * d + j] * r * w[j];
            }
            return y;
        };
        auto xs = cast<T>(x), ws = cast<T>(w), gs = cast<T>(gy);
        std::vector<T> y(n * d);
        launch({(unsigned)n}, {block}, Kernels<T>::rms_norm, xs.data(), ws.data(), y.data(), d, eps);
        const std::string dn = " d=" + std::to_string(d);
        expect(label<T>("rms_norm", block) + dn, widen(y), fwd(x, w), tolerance<T>());

        // The residual sum and its norm in one kernel: the sum rounded as an add writes it, and
        // the norm kernel's bits on it (every output written: both start as NaN).
        {
            const std::vector<T> a = cast<T>(values(n * d, 8, 3.0));
            std::vector<T> want_sum(n * d), want_y(n * d), sum(n * d, from_f32<T>(NAN)), y2(n * d, from_f32<T>(NAN));
            for (long long i = 0; i < n * d; ++i) want_sum[i] = from_f32<T>(to_f32(xs[i]) + to_f32(a[i]));
            launch({(unsigned)n}, {block}, Kernels<T>::rms_norm, (const T*)want_sum.data(), ws.data(), want_y.data(), d,
                   eps);
            launch({(unsigned)n}, {block}, Kernels<T>::add_rms_norm, xs.data(), a.data(), ws.data(), sum.data(),
                   y2.data(), d, eps);
            const bool same = std::memcmp(sum.data(), want_sum.data(), n * d * sizeof(T)) == 0 &&
                              std::memcmp(y2.data(), want_y.data(), n * d * sizeof(T)) == 0;
            ++checks;
            if (!same) ++failures;
            std::printf("%s %s%s: the add's and the norm kernel's bits\n", same ? "ok  " : "FAIL",
                        label<T>("add_rms_norm", block).c_str(), dn.c_str());
        }

        std::vector<T> dx(n * d), dw(d);
        std::vector<float> r(n);
        const long long rows_per_chunk = 2, chunks = (n + rows_per_chunk - 1) / rows_per_chunk;
        std::vector<float> partial(chunks * d);
        launch({(unsigned)n}, {block}, Kernels<T>::rms_norm_bwd_rows, xs.data(), gs.data(), ws.data(), dx.data(),
               r.data(), d, eps);
        launch({(unsigned)((d + 63) / 64), (unsigned)chunks}, {64}, Kernels<T>::dw_partial, xs.data(), gs.data(),
               (const float*)r.data(), partial.data(), n, d, rows_per_chunk);
        launch({(unsigned)((d + 31) / 32)}, {32}, Kernels<T>::dw_sum, (const float*)partial.data(), dw.data(), chunks, d);
        expect(label<T>("rms_norm dx", block) + dn, widen(dx),
               numeric_grad([&](const Vec& x) { return dot(fwd(x, w), gy); }, x), 4 * tolerance<T>());
        expect(label<T>("rms_norm dw", block) + dn, widen(dw),
               numeric_grad([&](const Vec& w) { return dot(fwd(x, w), gy); }, w), 4 * tolerance<T>());
    }
}

template <typename T> static void swiglu(unsigned block) {
    const long long n = 1000;
    const Vec g = rounded<T>(values(n, 1, 6.0)), u = rounded<T>(values(n, 2, 2.0)), dy = rounded<T>(values(n, 3, 1.0));
    auto fwd = [&](const Vec& g, const Vec& u) {
        Vec y(n);
        for (long long i = 0; i < n; ++i) y[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
        return y;
    };
    auto gs = cast<T>(g), us = cast<T>(u), dys = cast<T>(dy);
    std::vector<T> y(n), out(2 * n);
    // Three blocks: the grid-stride loop goes round several times.
    launch({3}, {block}, Kernels<T>::swiglu, gs.data(), us.data(), y.data(), n);
    expect(label<T>("swiglu", block), widen(y), fwd(g, u), tolerance<T>());
    launch({3}, {block}, Kernels<T>::swiglu_bwd, gs.data(), us.data(), dys.data(), out.data(), n);
    const Vec both = widen(out);
    expect(label<T>("swiglu dg", block), Vec(both.begin(), both.begin() + n),
           numeric_grad([&](const Vec& g) { return dot(fwd(g, u), dy); }, g), 4 * tolerance<T>());
    expect(label<T>("swiglu du", block), Vec(both.begin() + n, both.end()),
           numeric_grad([&](const Vec& u) { return dot(fwd(g, u), dy); }, u), 4 * tolerance<T>());
    // n = 1000 took the four-at-a-time loop; n − 1 (not a multiple of 4) takes the one-at-a-time
    // loop: the same bits.
    std::vector<T> y1(n - 1), out1(2 * (n - 1));
    launch({3}, {block}, Kernels<T>::swiglu, gs.data(), us.data(), y1.data(), n - 1);
    launch({3}, {block}, Kernels<T>::swiglu_bwd, gs.data(), us.data(), dys.data(), out1.data(), n - 1);
    const bool same = std::memcmp(y1.data(), y.data(), (n - 1) * sizeof(T)) == 0 &&
                      std::memcmp(out1.data(), out.data(), (n - 1) * sizeof(T)) == 0 &&
                      std::memcmp(out1.data() + n - 1, out.data() + n, (n - 1) * sizeof(T)) == 0;
    ++checks;
    if (!same) ++failures;
    std::printf("%s %s: four at a time and one at a time give the same bits\n", same ? "ok  " : "FAIL",
                label<T>("swiglu", block).c_str());
}

template <typename T> static void rope(unsigned block) {
    const long long b = 2, t = 3, h = 2, d = 8, half = d / 2, n = b * t * h * d;
    const Vec x = rounded<T>(values(n, 1, 2.0)), g = rounded<T>(values(n, 2, 1.0)), ang = values(b * t * half, 3, 3.0);
    Vec c, s;
    for (double a : ang) c.push_back(std::cos(a)), s.push_back(std::sin(a));
    c = rounded<T>(c), s = rounded<T>(s);
    // x [B, T, H, D] → [B, H, T, D], rotate-half.
    auto fwd = [&](const Vec& x) {
        Vec out(n);
        for (long long bi = 0; bi < b; ++bi)
            for (long long ti = 0; ti < t; ++ti)
                for (long long hi = 0; hi < h; ++hi)
                    for (long long k = 0; k < d; ++k) {
                        const double* xv = &x[((bi * t + ti) * h + hi) * d];
                        const long long tab = (bi * t + ti) * half + k % half;
                        const double rot = k < half ? -xv[k + half] : xv[k - half];
                        out[((bi * h + hi) * t + ti) * d + k] = xv[k] * c[tab] + rot * s[tab];
                    }
        return out;
    };
    auto xs = cast<T>(x), gs = cast<T>(g), cs = cast<T>(c), ss = cast<T>(s);
    std::vector<T> out(n), dx(n);
    launch({1}, {block}, Kernels<T>::rope, (const T*)xs.data(), (const T*)cs.data(), (const T*)ss.data(), out.data(), b, t,
           h, d, 0);
    expect(label<T>("rope", block), widen(out), fwd(x), tolerance<T>());
    launch({1}, {block}, Kernels<T>::rope, (const T*)gs.data(), (const T*)cs.data(), (const T*)ss.data(), dx.data(), b, t,
           h, d, 1);
    expect(label<T>("rope backward", block), widen(dx), numeric_grad([&](const Vec& x) { return dot(fwd(x), g); }, x),
           4 * tolerance<T>());

    // q (4 heads) and k (2 heads) in one launch, each with its bias added (rounded to T) or not:
    // the bits of the bias add (bias_add's formula) followed by the rope kernel.
    const long long hq = 4, hk = 2, nq = b * t * hq * d, nk = b * t * hk * d;
    const std::vector<T> q = cast<T>(values(nq, 4, 2.0)), k = cast<T>(values(nk, 5, 2.0));
    const std::vector<T> qb = cast<T>(values(hq * d, 6, 1.0)), kb = cast<T>(values(hk * d, 7, 1.0));
    for (int biased : {1, 0}) {
        auto biased_rope = [&](const std::vector<T>& x, const std::vector<T>& bias, long long h) {
            std::vector<T> y = x, out(x.size());
            if (biased)
                for (size_t i = 0; i < y.size(); ++i) y[i] = from_f32<T>(to_f32(x[i]) + to_f32(bias[i % (h * d)]));
            launch({1}, {block}, Kernels<T>::rope, (const T*)y.data(), (const T*)cs.data(), (const T*)ss.data(),
                   out.data(), b, t, h, d, 0);
            return out;
        };
        std::vector<T> qo(nq, from_f32<T>(NAN)), ko(nk, from_f32<T>(NAN));
        launch({2}, {block}, Kernels<T>::rope_pair, q.data(), qb.data(), k.data(), kb.data(), (const T*)cs.data(),
               (const T*)ss.data(), qo.data(), ko.data(), b, t, hq, hk, d, biased, biased);
        const std::vector<T> wq = biased_rope(q, qb, hq), wk = biased_rope(k, kb, hk);
        const bool same = std::memcmp(qo.data(), wq.data(), nq * sizeof(T)) == 0 &&
                          std::memcmp(ko.data(), wk.data(), nk * sizeof(T)) == 0;
        ++checks;
        if (!same) ++failures;
        std::printf("%s %s: q and k %s biases, the bits of %sthe rope kernel\n", same ? "ok  " : "FAIL",
                    label<T>("rope_pair", block).c_str(), biased ? "with" : "without", biased ? "the bias add and " : "");
    }
}

template <typename T> static void logprob_lse(unsigned block) {
    const long long n = 4, v = 300;
    const Vec z = rounded<T>(values(n * v, 1, 8.0));
    const std::vector<unsigned> y = {0, 299, 17, 150};
    const Vec g = rounded<T>(values(2 * n, 2, 1.0));  // (g_lp, g_lse) per row
    auto fwd = [&](const Vec& z) {  // (lp, lse) per row
        Vec out(2 * n);
        for (long long i = 0; i < n; ++i) {
            double m = -INFINITY, s = 0;
            for (long long j = 0; j < v; ++j) m = std::max(m, z[i * v + j]);
            for (long long j = 0; j < v; ++j) s += std::exp(z[i * v + j] - m);
            const double lse = m + std::log(s);
            out[2 * i] = z[i * v + y[i]] - lse, out[2 * i + 1] = lse;
        }
        return out;
    };
    auto zs = cast<T>(z);
    std::vector<T> out(2 * n);
    launch({(unsigned)n}, {block}, Kernels<T>::logprob_lse, (const T*)zs.data(), y.data(), out.data(), v);
    const Vec got = widen(out);
    expect(label<T>("logprob_lse", block), got, fwd(z), tolerance<T>());

    Vec rg;
    for (long long i = 0; i < n; ++i) rg.insert(rg.end(), {got[2 * i], got[2 * i + 1], g[2 * i], g[2 * i + 1]});
    auto rgs = cast<T>(rg);
    std::vector<T> dz(n * v);
    launch({(unsigned)n}, {block}, Kernels<T>::logprob_lse_bwd, (const T*)zs.data(), y.data(), (const T*)rgs.data(),
           dz.data(), v);
    expect(label<T>("logprob_lse backward", block), widen(dz),
           numeric_grad([&](const Vec& z) { return dot(fwd(z), g); }, z), 4 * tolerance<T>());

    // A target outside the vocabulary: NaN, never a read past the row.
    const std::vector<unsigned> bad = {0, 300, 1, 2};
    launch({(unsigned)n}, {block}, Kernels<T>::logprob_lse, (const T*)zs.data(), bad.data(), out.data(), v);
    ++checks;
    const bool nan = std::isnan(to_double(out[2])) && !std::isnan(to_double(out[0]));
    if (!nan) ++failures;
    std::printf("%s %s\n", nan ? "ok  " : "FAIL", label<T>("logprob_lse out-of-range target is NaN", block).c_str());

    // The mixed kernels: T logits with f32 outputs and output gradients are the f32 kernels'
    // bits on the cast logits (dz rounded once to T).
    const std::vector<float> zf = cast<float>(z), rgf = cast<float>(rg);
    std::vector<float> of(2 * n), om(2 * n), dzf(n * v);
    std::vector<T> dzm(n * v);
    launch({(unsigned)n}, {block}, Kernels<float>::logprob_lse, zf.data(), y.data(), of.data(), v);
    launch({(unsigned)n}, {block}, Kernels<T>::lse_mixed, (const T*)zs.data(), y.data(), om.data(), v, 1.0f);
    launch({(unsigned)n}, {block}, Kernels<float>::logprob_lse_bwd, zf.data(), y.data(), rgf.data(), dzf.data(), v);
    launch({(unsigned)n}, {block}, Kernels<T>::lse_bwd_mixed, (const T*)zs.data(), y.data(), rgf.data(), dzm.data(), v,
           1.0f);
    const std::vector<T> dzf_rounded = cast<T>(widen(dzf));
    const bool same = om == of && std::memcmp(dzm.data(), dzf_rounded.data(), dzm.size() * sizeof(T)) == 0;
    ++checks;
    if (!same) ++failures;
    std::printf("%s %s: the f32 kernels' bits\n", same ? "ok  " : "FAIL", label<T>("logprob_lse mixed", block).c_str());

    // At a temperature (scale = 1/T): the f32 kernels' bits on the logits cast and scaled in
    // f32, dz (with respect to the scaled logits) times the scale, rounded once to T.
    const float scale = 1.0f / 0.7f;
    std::vector<float> zsc(n * v);
    for (size_t i = 0; i < zsc.size(); ++i) zsc[i] = zf[i] * scale;
    launch({(unsigned)n}, {block}, Kernels<float>::logprob_lse, zsc.data(), y.data(), of.data(), v);
    launch({(unsigned)n}, {block}, Kernels<T>::lse_mixed, (const T*)zs.data(), y.data(), om.data(), v, scale);
    launch({(unsigned)n}, {block}, Kernels<float>::logprob_lse_bwd, zsc.data(), y.data(), rgf.data(), dzf.data(), v);
    launch({(unsigned)n}, {block}, Kernels<T>::lse_bwd_mixed, (const T*)zs.data(), y.data(), rgf.data(), dzm.data(), v,
           scale);
    std::vector<T> dz_scaled(n * v);
    for (size_t i = 0; i < dz_scaled.size(); ++i) dz_scaled[i] = from_f32<T>(scale * dzf[i]);
    const bool tempered = om == of && std::memcmp(dzm.data(), dz_scaled.data(), dzm.size() * sizeof(T)) == 0;
    ++checks;
    if (!tempered) ++failures;
    std::printf("%s %s: the f32 kernels' bits on the scaled logits\n", tempered ? "ok  " : "FAIL",
                label<T>("logprob_lse mixed at a temperature", block).c_str());
}

template <typename T> static void masked_softmax(unsigned block) {
    const long long b = 2, g = 3, t = 2, s = 37, rows = b * g * t;
    const float scale = 0.7f;
    const Vec x = rounded<T>(values(rows * s, 1, 4.0)), gout = rounded<T>(values(rows * s, 2, 1.0));
    Vec bias(b * t * s, 0.0);
    for (long long i = 0; i < b * t; ++i)
        for (long long j = 0; j < s; ++j)
            if ((j * 7 + i) % 5 == 0 && j != i) bias[i * s + j] = -1e30;  // masked keys; the diagonal stays
    bias = rounded<T>(bias);
    auto fwd = [&](const Vec& x) {
        Vec p(rows * s);
        for (long long r = 0; r < rows; ++r) {
            const double* br = &bias[((r / (g * t)) * t + r % t) * s];
            double m = -INFINITY, sum = 0;
            for (long long j = 0; j < s; ++j) m = std::max(m, x[r * s + j] * scale + br[j]);
            for (long long j = 0; j < s; ++j) sum += std::exp(x[r * s + j] * scale + br[j] - m);
            for (long long j = 0; j < s; ++j) p[r * s + j] = std::exp(x[r * s + j] * scale + br[j] - m) / sum;
        }
        return p;
    };
    auto xs = cast<T>(x), bs = cast<T>(bias), gs = cast<T>(gout);
    std::vector<T> p(rows * s), ds(rows * s);
    // A warp per row: the last block's warps past the rows do nothing.
    const dim3 grid{(unsigned)((rows + block / 32 - 1) / (block / 32))};
    launch(grid, {block}, Kernels<T>::masked_softmax, (const T*)xs.data(), (const T*)bs.data(), p.data(), rows, g, t,
           s, scale);
    expect(label<T>("masked_softmax", block), widen(p), fwd(x), tolerance<T>());
    launch(grid, {block}, Kernels<T>::masked_softmax_bwd, (const T*)p.data(), (const T*)gs.data(), ds.data(), rows,
           s, scale);
    expect(label<T>("masked_softmax backward", block), widen(ds),
           numeric_grad([&](const Vec& x) { return dot(fwd(x), gout); }, x), 4 * tolerance<T>());

    // The mixed kernels: T scores and gradients with an f32 bias are the f32 kernels' bits on the
    // casts: p rounded to T, and ds (from p computed again out of the rows' max and 1 / sum)
    // the f32 ds rounded once to T.
    const std::vector<float> xf = cast<float>(x), bf = cast<float>(bias), gf = cast<float>(gout);
    std::vector<float> pf(rows * s), dsf(rows * s), stats(2 * rows, NAN);
    std::vector<T> dsm(rows * s), pmx(rows * s);
    launch(grid, {block}, Kernels<float>::masked_softmax, xf.data(), bf.data(), pf.data(), rows, g, t, s, scale);
    launch(grid, {block}, Kernels<T>::softmax_mixed, (const T*)xs.data(), bf.data(), pmx.data(), stats.data(), rows, g,
           t, s, scale);
    launch(grid, {block}, Kernels<float>::masked_softmax_bwd, (const float*)pf.data(), gf.data(), dsf.data(), rows, s,
           scale);
    launch(grid, {block}, Kernels<T>::softmax_bwd_mixed, (const T*)xs.data(), bf.data(), (const float*)stats.data(),
           (const T*)gs.data(), dsm.data(), rows, g, t, s, scale);
    const std::vector<T> dsf_rounded = cast<T>(widen(dsf)), pf_rounded = cast<T>(widen(pf));
    const bool same = std::memcmp(dsm.data(), dsf_rounded.data(), dsm.size() * sizeof(T)) == 0 &&
                      std::memcmp(pmx.data(), pf_rounded.data(), pmx.size() * sizeof(T)) == 0;
    ++checks;
    if (!same) ++failures;
    std::printf("%s %s: the f32 kernels' bits (p also rounded to the scores' type)\n", same ? "ok  " : "FAIL",
                label<T>("masked_softmax mixed", block).c_str());
}

template <typename T> static void cached_attention(unsigned block) {
    const long long b = 2, h = 4, kvh = 2, t = 2, cap = 50;
    for (long long s : {3ll, 45ll})
        for (long long d : {40ll, 64ll}) {
            const float scale = 1.0f / std::sqrt((float)d);
            // The cache's buffers hold `cap` positions; k and v are views of the first s.
            const Vec q = rounded<T>(values(b * h * t * d, 1, 1.5)), k = rounded<T>(values(b * kvh * cap * d, 2, 1.5)),
                      v = rounded<T>(values(b * kvh * cap * d, 3, 1.5));
            Vec bias(b * t * s, 0.0);
            for (long long i = 0; i < t; ++i)  // row 1: the first two keys are left padding
                for (long long j = 0; j < std::min(2ll, s - 1); ++j) bias[(1 * t + i) * s + j] = -1e30;
            bias = rounded<T>(bias);
            Vec want(b * t * h * d);
            for (long long bi = 0; bi < b; ++bi)
                for (long long hi = 0; hi < h; ++hi)
                    for (long long i = 0; i < t; ++i) {
                        const long long gi = hi / (h / kvh);
                        Vec z(s);
                        double m = -INFINITY, sum = 0;
                        for (long long j = 0; j < s; ++j) {
                            double acc = 0;
                            for (long long e = 0; e < d; ++e)
                                acc += q[((bi * h + hi) * t + i) * d + e] * k[((bi * kvh + gi) * cap + j) * d + e];
                            z[j] = acc * scale + bias[(bi * t + i) * s + j];
                            m = std::max(m, z[j]);
                        }
                        for (long long j = 0; j < s; ++j) sum += (z[j] = std::exp(z[j] - m));
                        for (long long e = 0; e < d; ++e) {
                            double acc = 0;
                            for (long long j = 0; j < s; ++j) acc += z[j] / sum * v[((bi * kvh + gi) * cap + j) * d + e];
                            want[((bi * t + i) * h + hi) * d + e] = acc;
                        }
                    }
            auto qs = cast<T>(q), ks = cast<T>(k), vs = cast<T>(v), bs = cast<T>(bias);
            std::vector<T> out(b * t * h * d);
            launch({(unsigned)(b * h * t)}, {block}, Kernels<T>::cached_attention, (const T*)qs.data(), (const T*)ks.data(),
                   (const T*)vs.data(), (const T*)bs.data(), out.data(), h, kvh, t, s, d, kvh * cap * d, cap * d, d,
                   kvh * cap * d, cap * d, d, scale);
            expect(label<T>("cached_attention", block) + " s=" + std::to_string(s) + " d=" + std::to_string(d),
                   widen(out), want, tolerance<T>());
        }
}

// One token per row: greedy (the first of two equal maxima), and drawn at temperatures 1 and
// 0.7 against the inverse CDF computed here in double (the draws u sit well inside a token's
// interval), the log-probs against log-softmax in double; a NaN row gets the error token.
template <typename T> static void sample_rows(unsigned block) {
    const long long n = 5, v = 1001;
    Vec z = rounded<T>(values(n * v, 3, 6.0));
    z[0 * v + 700] = z[0 * v + 300] = 9.0;  // row 0: its maximum twice
    z[4 * v + 5] = NAN;                     // row 4: NaN
    const std::vector<float> inv_t = {0.0f, 1.0f, 1.0f / 0.7f, 0.0f, 1.0f};
    auto zs = cast<T>(z);
    const Vec zr = widen(zs);
    // The inverse CDF at the middle of a token's interval, for a token chosen by the row's index.
    std::vector<double> u(n, 0.0);
    std::vector<unsigned> want_tok(n);
    Vec want_lp(n);
    for (long long i = 0; i < 4; ++i) {
        const double* r = &zr[i * v];
        double m = -INFINITY, s = 0, sw = 0;
        for (long long j = 0; j < v; ++j) m = std::max(m, r[j]);
        for (long long j = 0; j < v; ++j) s += std::exp(r[j] - m);
        const double t = inv_t[i] == 0.0f ? 1.0 : (double)inv_t[i];
        for (long long j = 0; j < v; ++j) sw += std::exp((r[j] - m) * t);
        long long y = 0;
        if (inv_t[i] == 0.0f) {
            while (r[y] != m) ++y;
        } else {
            y = (i * 389 + 17) % v;
            double before = 0;
            for (long long j = 0; j < y; ++j) before += std::exp((r[j] - m) * t);
            u[i] = (before + 0.5 * std::exp((r[y] - m) * t)) / sw;
        }
        want_tok[i] = (unsigned)y;
        want_lp[i] = inv_t[i] == 0.0f || inv_t[i] == 1.0f ? r[y] - m - std::log(s) : (r[y] - m) * t - std::log(sw);
    }
    std::vector<unsigned> out(2 * n, 12345u);
    launch({(unsigned)n}, {block}, Kernels<T>::sample_rows, (const T*)zs.data(), inv_t.data(), u.data(), out.data(), v);
    Vec got_lp, want;
    bool tokens = true;
    for (long long i = 0; i < 4; ++i) {
        tokens = tokens && out[2 * i] == want_tok[i];
        float lp;
        std::memcpy(&lp, &out[2 * i + 1], 4);
        got_lp.push_back(lp);
        want.push_back(want_lp[i]);
    }
    ++checks;
    const bool nan_row = out[8] == 0xffffffffu;
    if (!tokens || !nan_row) ++failures;
    std::printf("%s %s: tokens %u %u %u %u (want %u %u %u %u), NaN row %s\n", tokens && nan_row ? "ok  " : "FAIL",
                label<T>("sample_rows", block).c_str(), out[0], out[2], out[4], out[6], want_tok[0], want_tok[1],
                want_tok[2], want_tok[3], nan_row ? "flagged" : "NOT flagged");
    expect(label<T>("sample_rows log-probs", block), got_lp, want, 2e-5);
}

// Σ x² in f64 over a grid of several blocks (partials, then one block adds them), against a
// double sum of the rounded inputs: a different order of exact-ish f64 adds.
template <typename T> static void sum_squares(unsigned block) {
    for (long long n : {1ll, 1000ll, 4099ll}) {
        const Vec x = rounded<T>(values(n, 11, 3.0));
        const auto xs = cast<T>(x);
        const unsigned blocks = 3;
        std::vector<double> partial(blocks), total(1);
        launch({blocks}, {block}, Kernels<T>::sum_squares, xs.data(), partial.data(), n);
        launch({1}, {block}, sum_partials, (const double*)partial.data(), total.data(), (long long)blocks);
        double want = 0;
        for (double v : x) want += v * v;
        expect(label<T>("sum_squares", block) + " n=" + std::to_string(n), total, {want}, 1e-14);
    }
}

// AdamW in place against the same f32 operations in the same order, written here: the same bits.
static void adamw(unsigned block) {
    const long long n = 1000;
    std::vector<float> p, m, v, g;
    for (double x : values(n, 21, 1.0)) p.push_back((float)x);
    for (double x : values(n, 22, 0.1)) m.push_back((float)x);
    for (double x : values(n, 23, 0.01)) v.push_back((float)(x * x));
    for (double x : values(n, 24, 0.5)) g.push_back((float)x);
    const float clip = 0.75f, b1 = 0.9f, b2 = 0.95f, one_b1 = 1.0f - 0.9f, one_b2 = (float)(1.0 - 0.95);
    const float decay = 0.999f, lr_b1 = 1e-3f / 0.1f, inv_b2 = 1.0f / 0.05f, eps = 1e-8f;
    std::vector<float> wp = p, wm = m, wv = v;
    for (long long i = 0; i < n; ++i) {
        const float gj = g[i] * clip;
        wm[i] = wm[i] * b1 + gj * one_b1;
        wv[i] = wv[i] * b2 + gj * gj * one_b2;
        const float denom = std::sqrt(wv[i] * inv_b2) + eps;
        wp[i] = wp[i] * decay - wm[i] * lr_b1 / denom;
    }
    launch({3}, {block}, adamw_step, p.data(), m.data(), v.data(), (const float*)g.data(), clip, b1, one_b1, b2, one_b2,
           decay, lr_b1, inv_b2, eps, n);
    const bool same = std::memcmp(p.data(), wp.data(), n * 4) == 0 && std::memcmp(m.data(), wm.data(), n * 4) == 0 &&
                      std::memcmp(v.data(), wv.data(), n * 4) == 0;
    ++checks;
    if (!same) ++failures;
    std::printf("%s adamw block %u: parameter and moments %s the f32 formulas' bits\n", same ? "ok  " : "FAIL", block,
                same ? "equal" : "DIFFER from");
}

// The transpose moves every element to its place: out[a][j][i] = x[a][i][j], bit for bit, for
// shapes under, at and over a tile's 32 in either dimension.
template <typename T> static void transpose(unsigned block) {
    for (auto [a, m, n] : {std::array<long long, 3>{1, 5, 7}, {3, 32, 33}, {2, 70, 31}, {1, 1, 100}}) {
        const std::vector<T> x = cast<T>(values(a * m * n, 7, 3.0));
        std::vector<T> out(a * m * n), want(a * m * n);
        for (long long b = 0; b < a; ++b)
            for (long long i = 0; i < m; ++i)
                for (long long j = 0; j < n; ++j) want[(b * n + j) * m + i] = x[(b * m + i) * n + j];
        launch({(unsigned)((n + 31) / 32), (unsigned)((m + 31) / 32), (unsigned)a}, {block}, Kernels<T>::transpose,
               x.data(), out.data(), m, n);
        const bool same = std::memcmp(out.data(), want.data(), out.size() * sizeof(T)) == 0;
        ++checks;
        if (!same) ++failures;
        std::printf("%s %s: [%lld, %lld, %lld] moved to its transpose\n", same ? "ok  " : "FAIL",
                    label<T>("transpose", block).c_str(), a, m, n);
    }
}

// The heads' transpose moves every element to its place: out[a][k][j][e] = x[a][j][k][e], bit
// for bit, 16 bytes at a time (rows of 64, and of 8: one chunk in bf16) and one element at a time
// (rows of 3; a row of 8 read from one element past an aligned start).
template <typename T> static void swap_heads(unsigned block) {
    for (auto [a, b, c, d, skip] : {std::array<long long, 5>{2, 3, 5, 64, 0}, {1, 4, 3, 3, 0}, {3, 2, 7, 8, 0},
                                    {1, 5, 2, 8, 1}}) {
        const std::vector<T> buffer = cast<T>(values(a * b * c * d + skip, 13, 3.0));
        const T* x = buffer.data() + skip;
        std::vector<T> out(a * b * c * d, from_f32<T>(NAN)), want(a * b * c * d);
        for (long long i = 0; i < a; ++i)
            for (long long j = 0; j < b; ++j)
                for (long long k = 0; k < c; ++k)
                    for (long long e = 0; e < d; ++e) want[((i * c + k) * b + j) * d + e] = x[((i * b + j) * c + k) * d + e];
        launch({3}, {block}, Kernels<T>::swap_heads, x, out.data(), b, c, d, a * b * c * d);
        const bool same = std::memcmp(out.data(), want.data(), out.size() * sizeof(T)) == 0;
        ++checks;
        if (!same) ++failures;
        std::printf("%s %s: [%lld, %lld, %lld, %lld] (from element %lld) to [a, c, b, d]\n", same ? "ok  " : "FAIL",
                    label<T>("swap_heads", block).c_str(), a, b, c, d, skip);
    }
}

// A parameter set from its f32 master is the master rounded to the parameter's type.
template <typename T> static void round_into(unsigned block) {
    const long long n = 1000;
    const std::vector<float> p = cast<float>(values(n, 8, 5.0));
    std::vector<T> w(n);
    launch({3}, {block}, Kernels<T>::round_into, w.data(), p.data(), n);
    const std::vector<T> want = cast<T>(widen(p));
    const bool same = std::memcmp(w.data(), want.data(), n * sizeof(T)) == 0;
    ++checks;
    if (!same) ++failures;
    std::printf("%s %s: the master rounded\n", same ? "ok  " : "FAIL", label<T>("round_into", block).c_str());
}

// The embedding table's gradient, the token's positions grouped on the host: candle's
// index_add (a thread per column adding every position in turn into a zero table), bit for bit.
template <typename T> static void embedding_grad(unsigned block) {
    const long long vocab = 9, width = 300, n = 12;
    const std::vector<unsigned> ids = {3, 0, 3, 8, 5, 3, 0, 7, 3, 5, 1, 3};
    const std::vector<T> dy = cast<T>(values(n * width, 9, 2.0));
    std::vector<T> want(vocab * width, from_f32<T>(0.0f));
    for (long long c = 0; c < width; ++c)
        for (long long j = 0; j < n; ++j) want[ids[j] * width + c] += dy[j * width + c];
    std::vector<unsigned> tokens, starts, order;  // grouped by token, positions in order
    for (unsigned tok = 0; tok < vocab; ++tok) {
        const size_t before = order.size();
        for (unsigned j = 0; j < n; ++j)
            if (ids[j] == tok) order.push_back(j);
        if (order.size() > before) tokens.push_back(tok), starts.push_back((unsigned)before);
    }
    starts.push_back((unsigned)order.size());
    std::vector<T> out(vocab * width, from_f32<T>(0.0f));
    launch({(unsigned)tokens.size()}, {block}, Kernels<T>::embedding_grad, tokens.data(), starts.data(), order.data(),
           dy.data(), out.data(), width);
    const bool same = std::memcmp(out.data(), want.data(), out.size() * sizeof(T)) == 0;
    ++checks;
    if (!same) ++failures;
    std::printf("%s %s: index_add's bits\n", same ? "ok  " : "FAIL", label<T>("embedding_grad", block).c_str());
}

// A gradient widened to f32 is each element converted (exactly), four at a time (n = 1000) or
// one at a time (n = 999).
template <typename T> static void widen(unsigned block) {
    for (long long n : {1000ll, 999ll}) {
        const std::vector<T> x = cast<T>(values(n, 10, 4.0));
        std::vector<float> out(n);
        launch({3}, {block}, Kernels<T>::widen, x.data(), out.data(), n);
        bool same = true;
        for (long long i = 0; i < n; ++i) same = same && out[i] == to_f32(x[i]);
        ++checks;
        if (!same) ++failures;
        std::printf("%s %s: %lld elements converted\n", same ? "ok  " : "FAIL", label<T>("widen", block).c_str(), n);
    }
}

// A bias added to every row: each output element (every one written: the output starts as NaN)
// is x + b[column] computed in f32 and rounded once, for rows of 1 and of 300 columns.
// The elementwise add: every sum bit for bit, four a load (sizes that are multiples of 4) and
// one at a time (the others, and a misaligned operand).
template <typename T> static void add(unsigned block) {
    for (long long n : {4096ll, 1000ll, 7ll, 1ll}) {
        for (long long offset : {0ll, 1ll}) {
            const std::vector<T> a = cast<T>(values(n + 1, 13, 4.0)), b = cast<T>(values(n, 14, 0.01));
            std::vector<T> out(n, from_f32<T>(NAN));
            launch({2}, {block}, Kernels<T>::add, a.data() + offset, b.data(), out.data(), n);
            bool same = true;
            for (long long i = 0; i < n; ++i) {
                const T want = from_f32<T>(to_f32(a[i + offset]) + to_f32(b[i]));
                same = same && std::memcmp(&out[i], &want, sizeof(T)) == 0;
            }
            ++checks;
            if (!same) ++failures;
            std::printf("%s %s: %lld elements, offset %lld\n", same ? "ok  " : "FAIL", label<T>("add", block).c_str(), n, offset);
        }
    }
}

template <typename T> static void bias_add(unsigned block) {
    for (auto [rows, n] : {std::array<long long, 2>{7, 300}, {5, 1}, {1, 3}}) {
        const std::vector<T> x = cast<T>(values(rows * n, 11, 4.0)), b = cast<T>(values(n, 12, 1.0));
        std::vector<T> out(rows * n, from_f32<T>(NAN));
        launch({2}, {block}, Kernels<T>::bias_add, x.data(), b.data(), out.data(), rows * n, n);
        bool same = true;
        for (long long i = 0; i < rows * n; ++i) {
            const T want = from_f32<T>(to_f32(x[i]) + to_f32(b[i % n]));
            same = same && std::memcmp(&out[i], &want, sizeof(T)) == 0;
        }
        ++checks;
        if (!same) ++failures;
        std::printf("%s %s: [%lld, %lld] + [%lld]\n", same ? "ok  " : "FAIL", label<T>("bias_add", block).c_str(), rows,
                    n, n);
    }
}

// Flash attention (bf16/f16, blocks of 128): the forward's output, and dq, dk, dv of
// L = Σ w ⊙ out, against attention computed here in double on the same rounded inputs. The
// double gradients are the textbook formulas; a few of their entries are checked against
// central differences of the double forward first, so that they are not a copy of the kernels'.
// Queries past a block's 64 and keys past a tile's 32, kv heads shared by two query heads, a
// causal mask with left padding, and queries after a prefix of keys (past > 0).
template <typename T> static double flash_tolerance() { return std::is_same<T, bf16>::value ? 6e-3 : 1e-3; }
template <typename T, int D, typename Fwd, typename Dq, typename Dkv, typename Delta, typename DkvSum>
static void flash_attention(Fwd fwd, Dq dq_kernel, Dkv dkv_kernel, Delta delta_kernel, DkvSum dkv_sum_kernel, long long b,
                            long long h, long long kvh, long long t, long long past) {
    const long long s = past + t, d = D, rep = h / kvh;
    const double scale = 1.0 / std::sqrt((double)d);
    const Vec q = rounded<T>(values(b * h * t * d, 11, 1.5)), k = rounded<T>(values(b * kvh * s * d, 12, 1.5)),
              v = rounded<T>(values(b * kvh * s * d, 13, 1.0)), w = rounded<T>(values(b * t * h * d, 14, 1.0));
    // Key j visible to query i (at position past + i): itself, or an earlier real key; row 1's
    // first three keys are padding.
    Vec bias(b * t * s, 0.0);
    for (long long bi = 0; bi < b; ++bi)
        for (long long i = 0; i < t; ++i)
            for (long long j = 0; j < s; ++j) {
                const bool visible = j == past + i || (j < past + i && !(bi == 1 && j < 3));
                if (!visible) bias[(bi * t + i) * s + j] = -1e30;
            }
    auto probs = [&](const Vec& q, const Vec& k, long long bi, long long hi, long long i) {
        const long long gi = hi / rep;
        Vec z(s);
        double m = -INFINITY, sum = 0;
        for (long long j = 0; j < s; ++j) {
            double acc = 0;
            for (long long e = 0; e < d; ++e) acc += q[((bi * h + hi) * t + i) * d + e] * k[((bi * kvh + gi) * s + j) * d + e];
            z[j] = acc * scale + bias[(bi * t + i) * s + j];
            m = std::max(m, z[j]);
        }
        for (long long j = 0; j < s; ++j) sum += (z[j] = std::exp(z[j] - m));
        for (double& x : z) x /= sum;
        return z;
    };
    auto forward = [&](const Vec& q, const Vec& k, const Vec& v) {
        Vec out(b * t * h * d, 0.0);
        for (long long bi = 0; bi < b; ++bi)
            for (long long hi = 0; hi < h; ++hi)
                for (long long i = 0; i < t; ++i) {
                    const Vec p = probs(q, k, bi, hi, i);
                    for (long long j = 0; j < s; ++j)
                        for (long long e = 0; e < d; ++e)
                            out[((bi * t + i) * h + hi) * d + e] += p[j] * v[((bi * kvh + hi / rep) * s + j) * d + e];
                }
        return out;
    };
    const Vec want = forward(q, k, v);
    Vec dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
    for (long long bi = 0; bi < b; ++bi)
        for (long long hi = 0; hi < h; ++hi)
            for (long long i = 0; i < t; ++i) {
                const long long gi = hi / rep;
                const Vec p = probs(q, k, bi, hi, i);
                const double* g = &w[((bi * t + i) * h + hi) * d];
                Vec dp(s, 0.0);
                double delta = 0;
                for (long long j = 0; j < s; ++j) {
                    for (long long e = 0; e < d; ++e) dp[j] += g[e] * v[((bi * kvh + gi) * s + j) * d + e];
                    delta += p[j] * dp[j];
                }
                for (long long j = 0; j < s; ++j) {
                    const double ds = p[j] * (dp[j] - delta) * scale;
                    for (long long e = 0; e < d; ++e) {
                        dq[((bi * h + hi) * t + i) * d + e] += ds * k[((bi * kvh + gi) * s + j) * d + e];
                        dk[((bi * kvh + gi) * s + j) * d + e] += ds * q[((bi * h + hi) * t + i) * d + e];
                        dv[((bi * kvh + gi) * s + j) * d + e] += p[j] * g[e];
                    }
                }
            }
    const std::string what = std::string("flash_attention ") + Kernels<T>::name + " d=" + std::to_string(d) +
                             " t=" + std::to_string(t) + " past=" + std::to_string(past);
    {  // the double gradients against differences, at a few entries of each input
        Vec got, fd;
        for (int which = 0; which < 3; ++which)
            for (size_t n = 0; n < 4; ++n) {
                Vec x[3] = {q, k, v};
                const size_t at = (n * 7919 + 13) % x[which].size();
                const double hstep = 1e-5, keep = x[which][at];
                x[which][at] = keep + hstep;
                const double up = dot(w, forward(x[0], x[1], x[2]));
                x[which][at] = keep - hstep;
                const double down = dot(w, forward(x[0], x[1], x[2]));
                fd.push_back((up - down) / (2 * hstep));
                got.push_back((which == 0 ? dq : which == 1 ? dk : dv)[at]);
            }
        expect(what + " (the double gradients against differences)", got, fd, 1e-6);
    }
    auto qs = cast<T>(q), ks = cast<T>(k), vs = cast<T>(v), ws = cast<T>(w);
    std::vector<float> bs(bias.begin(), bias.end()), stats(2 * b * h * t), delta(b * t * h);
    std::vector<T> out(b * t * h * d), gq(q.size()), gk(k.size()), gv(v.size());
    const dim3 table_tiles{(unsigned)((s + 31) / 32), (unsigned)((t + 31) / 32), (unsigned)b};
    std::vector<unsigned char> table(table_tiles.x * table_tiles.y * b, 9);
    launch(table_tiles, {32}, flash_attention_tiles, (const float*)bs.data(), table.data(), t, s);
    {  // the table against the bias: 0 masked throughout, 2 zero throughout, 1 otherwise
        Vec got, want;
        for (long long bi = 0; bi < b; ++bi)
            for (long long tq = 0; tq < table_tiles.y; ++tq)
                for (long long tk = 0; tk < table_tiles.x; ++tk) {
                    bool live = false, clear = true;
                    for (long long i = tq * 32; i < std::min(t, tq * 32 + 32); ++i)
                        for (long long j = tk * 32; j < std::min(s, tk * 32 + 32); ++j) {
                            live |= bias[(bi * t + i) * s + j] == 0.0;
                            clear &= bias[(bi * t + i) * s + j] == 0.0;
                        }
                    want.push_back(!live ? 0 : clear ? 2 : 1);
                    got.push_back(table[(bi * table_tiles.y + tq) * table_tiles.x + tk]);
                }
        expect(what + " bias table", got, want, 0.0);
    }
    const dim3 queries{(unsigned)((t + 63) / 64), (unsigned)h, (unsigned)b};
    launch(queries, {128}, fwd, (const T*)qs.data(), (const T*)ks.data(), (const T*)vs.data(), (const float*)bs.data(),
           (const unsigned char*)table.data(), out.data(), stats.data(), h, kvh, t, s, (float)scale);
    expect(what + " out", widen(out), want, flash_tolerance<T>());
    launch({(unsigned)((b * t * h + 7) / 8)}, {256}, delta_kernel, (const T*)ws.data(), (const T*)out.data(),
           delta.data(), b * t * h, d);
    launch(queries, {128}, dq_kernel, (const T*)qs.data(), (const T*)ks.data(), (const T*)vs.data(),
           (const float*)bs.data(), (const unsigned char*)table.data(), (const float*)stats.data(), (const T*)ws.data(), (const float*)delta.data(),
           gq.data(), h, kvh, t, s, (float)scale);
    std::vector<float> dk_part(b * h * s * d, NAN), dv_part(b * h * s * d, NAN);
    launch({(unsigned)((s + 63) / 64), (unsigned)h, (unsigned)b}, {128}, dkv_kernel, (const T*)qs.data(),
           (const T*)ks.data(), (const T*)vs.data(), (const float*)bs.data(), (const unsigned char*)table.data(),
           (const float*)stats.data(), (const T*)ws.data(), (const float*)delta.data(), dk_part.data(), dv_part.data(),
           h, kvh, t, s, (float)scale);
    launch({5}, {256}, dkv_sum_kernel, (const float*)dk_part.data(), (const float*)dv_part.data(), gk.data(), gv.data(),
           rep, s * d, b * kvh * s * d);
    expect(what + " dq", widen(gq), dq, flash_tolerance<T>());
    expect(what + " dk", widen(gk), dk, flash_tolerance<T>());
    expect(what + " dv", widen(gv), dv, flash_tolerance<T>());
}

static void flash_attention() {
    flash_attention<bf16, 64>(flash_attention_fwd_d64_bf16, flash_attention_dq_d64_bf16, flash_attention_dkv_d64_bf16,
                              flash_attention_delta_bf16, flash_attention_dkv_sum_bf16, 2, 4, 2, 70, 0);
    flash_attention<f16, 64>(flash_attention_fwd_d64_f16, flash_attention_dq_d64_f16, flash_attention_dkv_d64_f16,
                             flash_attention_delta_f16, flash_attention_dkv_sum_f16, 2, 4, 2, 70, 0);
    flash_attention<bf16, 128>(flash_attention_fwd_d128_bf16, flash_attention_dq_d128_bf16,
                               flash_attention_dkv_d128_bf16, flash_attention_delta_bf16, flash_attention_dkv_sum_bf16,
                               2, 2, 1, 20, 45);
}

template <typename T> static void all(unsigned block) {
    bias_add<T>(block);
    add<T>(block);
    transpose<T>(block);
    swap_heads<T>(block);
    widen<T>(block);
    embedding_grad<T>(block);
    round_into<T>(block);
    rms_norm<T>(block);
    swiglu<T>(block);
    rope<T>(block);
    logprob_lse<T>(block);
    masked_softmax<T>(block);
    cached_attention<T>(block);
    sample_rows<T>(block);
    sum_squares<T>(block);
}

int main() {
    for (unsigned block : {32u, 128u, 256u}) {
        all<float>(block);
        all<bf16>(block);
        all<f16>(block);
        adamw(block);
    }
    flash_attention();
    std::printf("emulated kernel checks: %d, failed: %d\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
