/*
 * plughost_device.h: the plughost device C ABI, version 1.
 *
 * Mirrors plugins/device-abi/src/abi.rs; a unit test there compares the
 * numbers below with the Rust layout, and the static asserts at the end
 * compare them with this compiler's layout.
 *
 * Contract:
 *  - a device library exports `plughost_device_v1`, returning a pointer to a
 *    static table; the host checks `abi_version` and `struct_size` before it
 *    touches any function pointer, and refuses null entries;
 *  - functions that can fail return a status code (0 = ok); after a failure,
 *    `last_error` on the same handle returns the message (with a NULL handle:
 *    the last failure on the calling thread of a call that had no handle,
 *    such as `open`);
 *  - no C++ exception or Rust panic crosses the boundary;
 *  - a handle may move between threads, but calls on one handle must not
 *    overlap.
 *
 * Callables every device provides, in this order (index = position). Shapes
 * use T flattened tokens, S sequences, E emitting rows, H hidden, V vocab,
 * D head_dim, B KV blocks, bs block size, M blocks per sequence. W is a
 * weight: f32, f16 or bf16. Q is a matrix: a W or a block-quantized weight
 * (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K in ggml's layouts). C is a KV cache: f32, f16 or bf16, the same for
 * the keys and values of a launch; kv_write rounds to it (nearest even).
 * Float params are passed as their IEEE-754 bits.
 *  0 embedding_gather(ids i32[T], table Q[V,H], out f32[T,H])
 *  1 rms_norm(x f32[T,H], weight W[H], out f32[T,H]; eps)
 *  2 rms_norm_heads(x f32[T,N*D] inout, weight W[D]; eps, head_dim)
 *  3 linear(x f32[T,K], w Q[N,K], out f32[T,N])            out = x . w^T
 *  4 rotary(q f32[T,Hq*D] inout, k f32[T,Hk*D] inout, positions i32[T];
 *           head_dim, inv_freq...)                          rotate-half
 *           inv_freq: the last D/2 params, one f32 inverse frequency per pair
 *           (i, i + D/2), computed by the model glue (default, Llama 3, YaRN)
 *  5 kv_write(k f32[T,Hk*D], v f32[T,Hk*D], key_cache C[B,Hk,bs,D] out,
 *             value_cache C[B,Hk,bs,D] out, slot_mapping i32[T])
 *             slot s is row s % bs of block s / bs; slot < 0 skips the row
 *  6 paged_attention(q f32[T,Hq*D], key_cache, value_cache,
 *                    block_table i32[S,M], seq_lens i32[S],
 *                    query_start i32[S+1], out f32[T,Hq*D];
 *                    num_heads, num_kv_heads, head_dim, block_size, scale)
 *  7 silu_mul(gate f32[T,I], up f32[T,I], out f32[T,I])
 *  8 add(x f32[T,H] inout, y f32[T,H])
 *  9 gather_rows(x f32[T,H], indices i32[E], out f32[E,H])
 * 10 advance_seq_lens(seq_lens i32[S] inout, query_start i32[S+1])
 * 11 derive_positions(seq_lens i32[S], query_start i32[S+1],
 *                     positions i32[T] out)
 * 12 derive_slot_mapping(block_table i32[S,M], seq_lens i32[S],
 *                        query_start i32[S+1], slot_mapping i32[T] out;
 *                        block_size)
 * 13 qkv_linear(x f32[T,K], wq Q[Q,K], wk Q[R,K], wv Q[R,K],
 *               q f32[T,Q] out, k f32[T,R] out, v f32[T,R] out)
 *               three linears over one x; wq, wk and wv share a dtype
 *               or are all block-quantized
 * 14 silu_gate_linear(x f32[T,K], w_gate Q[I,K], w_up Q[I,K],
 *                     out f32[T,I])   out = silu(x . w_gate^T) * (x . w_up^T)
 *                     w_gate and w_up share a dtype or are both
 *                     block-quantized
 * 15 add_rms_norm(x f32[T,H] inout, y f32[T,H], weight W[H],
 *                 out f32[T,H]; eps)   x += y, then out = rms_norm(x)
 * 16 bias_add(x f32[T,N] inout, bias W[N])   x[t,:] += bias
 * 17 paged_attention_window(the arguments of paged_attention;
 *                           num_heads, num_kv_heads, head_dim, block_size,
 *                           scale, window)
 *                           a token at position p attends to positions
 *                           max(0, p - window + 1)..=p
 * Arguments a callable writes accept tags OUTPUT, OUTPUT_EXISTING, INOUT and
 * NO_DEP; arguments it reads accept INPUT, INOUT and NO_DEP; arguments it
 * reads and writes accept INOUT and NO_DEP.
 */
#ifndef PLUGHOST_DEVICE_H
#define PLUGHOST_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PLUGHOST_DEVICE_ABI_VERSION 1
#define PLUGHOST_DEVICE_ENTRY_SYMBOL "plughost_device_v1"
#define PLUGHOST_MAX_RANK 4

/* Status codes. */
#define PLUGHOST_STATUS_OK 0
#define PLUGHOST_STATUS_INVALID_ARGUMENT 1
#define PLUGHOST_STATUS_OUT_OF_MEMORY 2
#define PLUGHOST_STATUS_UNKNOWN_BUFFER 3
#define PLUGHOST_STATUS_OUT_OF_BOUNDS 4
#define PLUGHOST_STATUS_LAUNCH_FAILED 5
#define PLUGHOST_STATUS_INTERNAL 6

/* Element types (the order of the WIT enum program.dtype). */
#define PLUGHOST_DTYPE_F32 0
#define PLUGHOST_DTYPE_F16 1
#define PLUGHOST_DTYPE_BF16 2
#define PLUGHOST_DTYPE_I32 3
#define PLUGHOST_DTYPE_I64 4
#define PLUGHOST_DTYPE_U8 5
/* Block-quantized weights in ggml's block layouts (weights only; rows are whole blocks). */
#define PLUGHOST_DTYPE_Q8_0 6
#define PLUGHOST_DTYPE_Q4_0 7
#define PLUGHOST_DTYPE_Q4_1 8
#define PLUGHOST_DTYPE_Q4_K 9
#define PLUGHOST_DTYPE_Q6_K 10

/* Argument tags (the order of the WIT enum program.arg-tag). */
#define PLUGHOST_TAG_INPUT 0
#define PLUGHOST_TAG_OUTPUT 1
#define PLUGHOST_TAG_INOUT 2
#define PLUGHOST_TAG_OUTPUT_EXISTING 3
#define PLUGHOST_TAG_NO_DEP 4

/* Layout, checked against Rust by a unit test and against C below. */
#define PLUGHOST_TENSOR_ARG_SIZE 64
#define PLUGHOST_TENSOR_ARG_OFFSET_OFFSET 8
#define PLUGHOST_TENSOR_ARG_OFFSET_DTYPE 16
#define PLUGHOST_TENSOR_ARG_OFFSET_NDIM 20
#define PLUGHOST_TENSOR_ARG_OFFSET_SHAPE 24
#define PLUGHOST_TENSOR_ARG_OFFSET_TAG 56
#define PLUGHOST_DEVICE_STATS_SIZE 72
#define PLUGHOST_DEVICE_STATS_OFFSET_LAUNCHES 64
#define PLUGHOST_DEVICE_TABLE_V1_SIZE_LP64 136
#define PLUGHOST_DEVICE_TABLE_V1_OFFSET_LAST_ERROR_LP64 104
/* A table of this size (everything up to callable_device_ns) is accepted too. */
#define PLUGHOST_DEVICE_TABLE_V1_MIN_SIZE_LP64 112
/* A revision 1.1 table ends before copy_out_start. */
#define PLUGHOST_DEVICE_TABLE_V1_SIZE_1_1_LP64 120
#define PLUGHOST_COPY_RANGE_SIZE 24

/* The opaque device state behind a handle. */
typedef struct plughost_device plughost_device;

/* One tensor argument: a typed, shaped view into a device buffer. Entries of
 * `shape` past `ndim` are ignored. */
typedef struct plughost_tensor_arg {
    uint64_t buffer;
    uint64_t offset; /* bytes */
    uint32_t dtype;  /* PLUGHOST_DTYPE_* */
    uint32_t ndim;
    uint64_t shape[PLUGHOST_MAX_RANK];
    uint32_t tag; /* PLUGHOST_TAG_* */
} plughost_tensor_arg;

/* Counters since open. */
typedef struct plughost_device_stats {
    uint64_t allocations;
    uint64_t frees;
    uint64_t live_allocations;
    uint64_t live_bytes;
    uint64_t h2d_bytes;
    uint64_t h2d_calls;
    uint64_t d2h_bytes;
    uint64_t d2h_calls;
    uint64_t launches; /* successful launches, all callables */
} plughost_device_stats;

/* Revision 1.2: one byte range of a device buffer, a piece of a copy out. */
typedef struct plughost_copy_range {
    uint64_t buffer;
    uint64_t offset;
    uint64_t len;
} plughost_copy_range;

/* The prefix every table version starts with. */
typedef struct plughost_device_header {
    uint32_t abi_version;
    uint32_t struct_size; /* sizeof the whole table */
} plughost_device_header;

typedef struct plughost_device_table_v1 {
    uint32_t abi_version; /* PLUGHOST_DEVICE_ABI_VERSION */
    uint32_t struct_size; /* sizeof(plughost_device_table_v1) */

    /* `config` format is the device's own; NULL means "". */
    int32_t (*open)(const char *config, plughost_device **out_handle);
    /* Releases every buffer and the handle; NULL is ignored. */
    void (*close)(plughost_device *handle);

    /* Zeroed bytes; ids are never 0 and never reused while open. */
    int32_t (*alloc)(plughost_device *handle, uint64_t bytes, uint64_t *out_buffer);
    int32_t (*free)(plughost_device *handle, uint64_t buffer);
    /* Host to device. */
    int32_t (*write)(plughost_device *handle, uint64_t buffer, uint64_t offset,
                     const uint8_t *src, uint64_t len);
    /* Device to host. */
    int32_t (*read)(plughost_device *handle, uint64_t buffer, uint64_t offset,
                    uint8_t *dst, uint64_t len);

    uint32_t (*callable_count)(plughost_device *handle);
    /* NUL-terminated, valid while open; NULL for an index out of range. */
    const char *(*callable_name)(plughost_device *handle, uint32_t index);
    int32_t (*launch)(plughost_device *handle, uint32_t callable_index,
                      const plughost_tensor_arg *args, uint32_t num_args,
                      const int64_t *params, uint32_t num_params);
    /* Device time since the previous synchronize. */
    int32_t (*synchronize)(plughost_device *handle, uint64_t *out_device_ns);
    int32_t (*stats)(plughost_device *handle, plughost_device_stats *out);
    /* Successful launches of one callable; 0 for an index out of range. */
    uint64_t (*callable_launches)(plughost_device *handle, uint32_t index);
    /* Copies the last failure's message, truncated to buf_len - 1 bytes and
     * NUL-terminated; returns the full length like snprintf. */
    size_t (*last_error)(plughost_device *handle, char *buf, size_t buf_len);

    /* Appended in revision 1.1; a host reads it only from a table whose struct_size
     * covers it, and NULL means the device does not report it.
     * Nanoseconds of device time spent in each callable's successful launches since
     * open, into out[0..min(len, count)); returns the callable count. */
    uint32_t (*callable_device_ns)(plughost_device *handle, uint64_t *out, uint32_t len);

    /* Appended in revision 1.2, both or neither (NULL: the host copies with `read`).
     * copy_out_start checks every range, starts copying them in order into
     * consecutive bytes of dst (dst_len = their total) and returns at once; at most
     * one copy is in flight per handle. Until copy_out_poll reports it done or
     * failed (or close), the host keeps dst valid and untouched, writes no byte of
     * the ranges (by write or launch; launches may read them) and frees none of
     * their buffers. copy_out_poll writes 1 to *out_done when the copy finished (or
     * none is in flight), 0 while it runs; with wait != 0 it returns when it
     * finished. A failed copy returns its status (message in last_error). */
    int32_t (*copy_out_start)(plughost_device *handle, const plughost_copy_range *ranges,
                              uint32_t num_ranges, uint8_t *dst, uint64_t dst_len);
    int32_t (*copy_out_poll)(plughost_device *handle, uint32_t wait, uint32_t *out_done);
} plughost_device_table_v1;

typedef const plughost_device_table_v1 *(*plughost_device_entry_fn)(void);

/* The one symbol a device library exports. */
const plughost_device_table_v1 *plughost_device_v1(void);

#ifdef __cplusplus
#define PLUGHOST_STATIC_ASSERT(condition, message) static_assert(condition, message)
#else
#define PLUGHOST_STATIC_ASSERT(condition, message) _Static_assert(condition, message)
#endif

PLUGHOST_STATIC_ASSERT(sizeof(plughost_tensor_arg) == PLUGHOST_TENSOR_ARG_SIZE,
                       "plughost_tensor_arg size");
PLUGHOST_STATIC_ASSERT(offsetof(plughost_tensor_arg, offset) == PLUGHOST_TENSOR_ARG_OFFSET_OFFSET,
                       "plughost_tensor_arg.offset");
PLUGHOST_STATIC_ASSERT(offsetof(plughost_tensor_arg, dtype) == PLUGHOST_TENSOR_ARG_OFFSET_DTYPE,
                       "plughost_tensor_arg.dtype");
PLUGHOST_STATIC_ASSERT(offsetof(plughost_tensor_arg, ndim) == PLUGHOST_TENSOR_ARG_OFFSET_NDIM,
                       "plughost_tensor_arg.ndim");
PLUGHOST_STATIC_ASSERT(offsetof(plughost_tensor_arg, shape) == PLUGHOST_TENSOR_ARG_OFFSET_SHAPE,
                       "plughost_tensor_arg.shape");
PLUGHOST_STATIC_ASSERT(offsetof(plughost_tensor_arg, tag) == PLUGHOST_TENSOR_ARG_OFFSET_TAG,
                       "plughost_tensor_arg.tag");
PLUGHOST_STATIC_ASSERT(sizeof(plughost_copy_range) == PLUGHOST_COPY_RANGE_SIZE,
                       "plughost_copy_range size");
PLUGHOST_STATIC_ASSERT(sizeof(plughost_device_stats) == PLUGHOST_DEVICE_STATS_SIZE,
                       "plughost_device_stats size");
PLUGHOST_STATIC_ASSERT(offsetof(plughost_device_stats, launches) ==
                           PLUGHOST_DEVICE_STATS_OFFSET_LAUNCHES,
                       "plughost_device_stats.launches");
PLUGHOST_STATIC_ASSERT(sizeof(void *) != 8 ||
                           sizeof(plughost_device_table_v1) == PLUGHOST_DEVICE_TABLE_V1_SIZE_LP64,
                       "plughost_device_table_v1 size");
PLUGHOST_STATIC_ASSERT(sizeof(void *) != 8 ||
                           offsetof(plughost_device_table_v1, last_error) ==
                               PLUGHOST_DEVICE_TABLE_V1_OFFSET_LAST_ERROR_LP64,
                       "plughost_device_table_v1.last_error");

#ifdef __cplusplus
}
#endif

#endif /* PLUGHOST_DEVICE_H */
