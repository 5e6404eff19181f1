// A whole scan as one kernel: ${summary}
// Each block owns ROWS batch rows and runs every step: carries and temporaries live in shared
// memory; each thread loads its share of the next step's inputs into registers while this step
// computes (one block an SM: the grid is at most one wave). A block barrier follows an op only where a later op reads elements another thread wrote.
${common}

#define BLOCK ${block}
#define ROWS ${rows}
#define BATCH ${batch}
#define LENGTH ${length}

extern "C" __global__ void __launch_bounds__(BLOCK, 1) ${name}(${params} JS_ROWS_PARAM) {
  const int tid = threadIdx.x;
  extern __shared__ __align__(16) unsigned char js_dyn[];
  const int row0 = blockIdx.x * ROWS;
  const int nrows = min(ROWS, BATCH - row0);
${arrays}
${prologue}
  __syncthreads();
  for (int it = 0; it < LENGTH; ++it) {
    const int t = ${step};
    const int t_next = ${step_next};
${prefetch}
${body}
${stores}
    __syncthreads();  // every read of this step's carries and inputs is done
${advance}
    __syncthreads();
  }
${epilogue}
}
