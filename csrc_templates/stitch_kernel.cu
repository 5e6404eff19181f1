// One stitched region: ${summary}
// Rows are walked by groups of TPR threads (grid-stride over row groups); each thread keeps its
// E = VPT * V elements of a row (of each of CHUNKS chunks of it) in registers.
${common}

#define N_ROWS ${n_rows}LL
#define N_COLS ${n_cols}
#define V ${vec}
#define TPR ${tpr}
#define VPT ${vpt}
#define CHUNKS ${chunks}
#define E (VPT * V)
#define RPB ${rows_per_block}
#define BLOCK ${block}
#define NWARPS_ROW ((TPR + 31) / 32)

extern "C" __global__ void __launch_bounds__(BLOCK, ${min_blocks}) ${name}(${params}) {
  const int tid = threadIdx.x;
  const int lane = tid % TPR;
  const int row_in_block = tid / TPR;
${shared}
${prologue}
  for (long long base = (long long)blockIdx.x * RPB; base < N_ROWS; base += (long long)gridDim.x * RPB) {
    const long long row = base + row_in_block;
    const bool row_ok = row < N_ROWS;
${body}
  }
${epilogue}
}
