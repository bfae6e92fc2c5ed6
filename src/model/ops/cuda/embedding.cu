// The gradient of the embedding table (see embedding.rs): dE[tokens[b]] = Σ dy[order[k]] for k
// in starts[b] .. starts[b + 1], the positions of token tokens[b] in position order. A block per
// token that occurs; its threads take the columns. Each element is summed from zero in the
// table's type, one `+=` per position in position order: the additions candle's index_add
// makes for it (one thread per column walking every position), so the same bits. Rows of
// tokens that do not occur are left as they are (zero).
#include "common.cuh"

template <typename T>
__device__ void embedding_grad_kernel(const unsigned int* tokens, const unsigned int* starts,
                                      const unsigned int* order, const T* dy, T* out, long long width) {
    const long long b = blockIdx.x;
    const long long first = starts[b], last = starts[b + 1];
    T* row = out + (long long)tokens[b] * width;
    for (long long c = threadIdx.x; c < width; c += blockDim.x) {
        T acc = from_f32<T>(0.0f);
        for (long long k = first; k < last; ++k) acc += dy[(long long)order[k] * width + c];
        row[c] = acc;
    }
}
#define EMBEDDING_GRAD_PARAMS(T)                                                                          \
    (const unsigned int* tokens, const unsigned int* starts, const unsigned int* order, const T* dy, T* out, \
     long long width)
INSTANTIATE(embedding_grad, EMBEDDING_GRAD_PARAMS, (tokens, starts, order, dy, out, width))
