// How a step's prefill segments split into work, shared by the prefill kernels (bf16 and fp32): each
// (segment, KV head)'s keys and values are packed once into a kernel-specific layout, then tasks (a block of
// query positions x one KV head's GQA group) walk their causal key range. Tasks are handed out dynamically,
// costliest first: causal blocks near the end of a prompt see more keys than those at its start.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace prefill {

struct Segment {
  int64_t token_start, num_queries, num_past, key_begin, num_keys;  // keys [key_begin, key_begin + num_keys)
  const int64_t* table;
  int64_t packed_offset;  // elements into the packed K (and V) buffer of each KV head
};

// What every task of a call needs to know of the query and output tensors.
struct Shape {
  int64_t head_dim, group, q_stride, out_stride, sliding_window;  // strides in elements, per token
  float scale;
  int64_t block_size, num_kv_heads;  // of the cache
};

// Checks the query, output and cache shapes common to the prefill kernels; the dtypes are each kernel's own.
inline Shape query_shape(const at::Tensor& q, const at::Tensor& out, at::IntArrayRef cache_shape,
                         int64_t head_dim_multiple, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [tokens, heads, head_dim], rows dense");
  TORCH_CHECK(out.is_contiguous(), "out contiguous");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = cache_shape[2];
  TORCH_CHECK(head_dim % head_dim_multiple == 0, "head_dim must be a multiple of ", head_dim_multiple);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  return Shape{head_dim, num_heads / num_kv_heads, q.stride(0), out.stride(0), sliding_window,
               static_cast<float>(scale), cache_shape[1], num_kv_heads};
}

struct Task {
  int64_t segment, kv_head, first, count;  // query positions [first, first + count) of the segment
};

// Checks the common inputs; returns the segments and the packed buffer size per KV head (each segment's keys
// padded to whole chunks of `chunk` keys, so tile reads stay inside the buffer).
inline std::vector<Segment> plan_segments(const at::Tensor& block_tables, const at::Tensor& query_starts,
                                          const at::Tensor& num_past, int64_t block_size, int64_t head_dim,
                                          int64_t sliding_window, int64_t chunk, int64_t& packed_size) {
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: int64");
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && num_past.scalar_type() == at::kLong,
              "query_starts, num_past: int64");
  const int64_t num_segments = num_past.size(0), max_blocks = block_tables.size(1);
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* past = num_past.data_ptr<int64_t>();
  std::vector<Segment> segments(num_segments);
  packed_size = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    Segment& seg = segments[s];
    seg.token_start = starts[s];
    seg.num_queries = starts[s + 1] - starts[s];
    seg.num_past = past[s];
    // A window hides keys older than the first query's window: they are never packed.
    seg.key_begin = sliding_window > 0 ? std::max<int64_t>(0, seg.num_past - sliding_window + 1) : 0;
    seg.num_keys = seg.num_past + seg.num_queries - seg.key_begin;
    TORCH_CHECK((seg.num_past + seg.num_queries + block_size - 1) / block_size <= max_blocks, "block table too short");
    seg.table = block_tables.data_ptr<int64_t>() + s * max_blocks;
    seg.packed_offset = packed_size;
    packed_size += (seg.num_keys + chunk - 1) / chunk * chunk * head_dim;
  }
  return segments;
}

inline std::vector<Task> plan_tasks(const std::vector<Segment>& segments, int64_t num_kv_heads, int64_t group,
                                    int64_t rows_target) {
  std::vector<Task> tasks;
  const int64_t positions_per_task = std::max<int64_t>(1, rows_target / group);
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s)
    for (int64_t first = 0; first < segments[s].num_queries; first += positions_per_task)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        tasks.push_back({s, h, first, std::min(positions_per_task, segments[s].num_queries - first)});
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return segments[a.segment].num_past + a.first > segments[b.segment].num_past + b.first;
  });
  return tasks;
}

// The cache slot of a segment's key `i` (counted from key_begin).
inline int64_t key_slot(const Segment& seg, int64_t i, int64_t block_size) {
  const int64_t pos = seg.key_begin + i;
  return seg.table[pos / block_size] * block_size + pos % block_size;
}

// Runs both phases on the step's threads: pack(segment, kv_head) for every pair, then attend(task, scratch)
// for every task, costliest first, each thread with its own Scratch.
template <typename Scratch, typename Pack, typename Attend>
void run(const std::vector<Segment>& segments, const std::vector<Task>& tasks, int64_t num_kv_heads, Pack&& pack,
         Attend&& attend) {
  const int threads = at::get_num_threads();
  const int64_t num_pairs = static_cast<int64_t>(segments.size()) * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t pair = 0; pair < num_pairs; ++pair) pack(segments[pair / num_kv_heads], pair % num_kv_heads);
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i) attend(tasks[i], segments[tasks[i].segment], scratch);
  }
}

// The whole plan: segments and tasks, a packed K and V buffer of `elem_t` per KV head, then both phases.
// pack(seg, head, k_dst, v_dst) fills one pair's packed keys and values; attend(task, seg, k_src, v_src, scratch)
// reads them.
template <typename Scratch, typename elem_t, typename Pack, typename Attend>
void pack_and_attend(const Shape& shape, const at::Tensor& block_tables, const at::Tensor& query_starts,
                     const at::Tensor& num_past, int64_t chunk, int64_t rows_target, at::TensorOptions options,
                     Pack&& pack, Attend&& attend) {
  const int64_t num_kv_heads = shape.num_kv_heads;
  int64_t packed_size = 0;  // per KV head
  const std::vector<Segment> segments = plan_segments(block_tables, query_starts, num_past, shape.block_size,
                                                      shape.head_dim, shape.sliding_window, chunk, packed_size);
  auto k_packed = at::empty({num_kv_heads, packed_size}, options);
  auto v_packed = at::empty({num_kv_heads, packed_size}, options);
  elem_t* kp = reinterpret_cast<elem_t*>(k_packed.data_ptr());
  elem_t* vp = reinterpret_cast<elem_t*>(v_packed.data_ptr());
  const std::vector<Task> tasks = plan_tasks(segments, num_kv_heads, shape.group, rows_target);
  run<Scratch>(
      segments, tasks, num_kv_heads,
      [&](const Segment& seg, int64_t h) {
        elem_t* k = kp + h * packed_size + seg.packed_offset;
        elem_t* v = vp + h * packed_size + seg.packed_offset;
        // What tiles read past the keys must be zero: from the last tile that is not full (16 keys or fewer
        // each, head_dim elements a key in both layouts) to the padded end; the pack writes the rest.
        const int64_t tail = seg.num_keys / 16 * 16 * shape.head_dim;
        const int64_t end = (seg.num_keys + chunk - 1) / chunk * chunk * shape.head_dim;
        std::fill(k + tail, k + end, elem_t(0));
        std::fill(v + tail, v + end, elem_t(0));
        pack(seg, h, k, v);
      },
      [&](const Task& t, const Segment& seg, Scratch& scratch) {
        attend(t, seg, kp + t.kv_head * packed_size + seg.packed_offset, vp + t.kv_head * packed_size + seg.packed_offset,
               scratch);
      });
}

}  // namespace prefill
