// Remote stitching: ${summary}
// Independent elementwise chains in one launch. Block t works on task t: a TILE-element tile of the
// member whose tasks include t (a binary search of the task table). Members with one op structure
// share a code body, their buffers found through that body's table. The kernel's one parameter is
// the table of every buffer's pointer (inputs, then outputs), passed by value.
${common}

#define BLOCK ${block}
#define V ${vec}
#define TILE ${tile}
#define MEMBERS ${members}

struct js_ptrs { void* p[${n_buffers}]; };
__constant__ long long js_first_task[MEMBERS + 1] = {${first_tasks}};
__constant__ long long js_size[MEMBERS] = {${sizes}};
__constant__ int js_body[MEMBERS] = {${bodies}};
__constant__ int js_slot[MEMBERS] = {${slots}};
${tables}

extern "C" __global__ void __launch_bounds__(BLOCK) ${name}(const __grid_constant__ js_ptrs P) {
  const long long task = blockIdx.x;
  int m = 0, hi = MEMBERS;
  while (hi - m > 1) {
    const int mid = (m + hi) / 2;
    if (js_first_task[mid] <= task) m = mid; else hi = mid;
  }
  const long long start = (task - js_first_task[m]) * TILE;
  const long long end = min(start + TILE, js_size[m]);
  switch (js_body[m]) {
${cases}
  }
}
