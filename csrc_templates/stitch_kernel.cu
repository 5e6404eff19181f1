// One stitched region: ${summary}
// Rows are walked by groups of TPR threads (grid-stride over row groups); each thread keeps its
// E = VPT * V elements of a row (of each of CHUNKS chunks of it) in registers; a shared stash holds
// the first STASH_CHUNKS chunks. With SPLITS > 1 a
// block's task is one SLICE of a row, ROW_C0 its first column, ROW_COLS its length.
${common}

#define N_ROWS js_n_rows  // (JS_ROWS_PARAM)
#define N_COLS ${n_cols}
#define V ${vec}
#define TPR ${tpr}
#define VPT ${vpt}
#define CHUNKS ${chunks}
#define STASH_CHUNKS ${stash_chunks}
#define E (VPT * V)
#define RPB ${rows_per_block}
#define BLOCK ${block}
#define NWARPS_ROW ((TPR + 31) / 32)
#define SPLITS ${splits}
#define SLICE ${slice}
#define N_TASKS (N_ROWS * SPLITS)
#define ROW_C0 ${row_c0}
#define ROW_COLS ${row_cols}
// The first column of this thread's vector k in chunk ch (vectors of V, TPR threads a row).
#define JS_VEC_COL(k) (${vec_col})
${functions}

extern "C" __global__ void __launch_bounds__(BLOCK, ${min_blocks}) ${name}(${params} JS_ROWS_PARAM) {
  const int tid = threadIdx.x;
  const int lane = tid % TPR;
  const int row_in_block = tid / TPR;
${shared}
${prologue}
${loop_head}
${body}
  }
${epilogue}
}
