// Translation unit compiled at run time (one module per kernel variant): the forward and merge
// kernel templates.  The launcher instantiates them through name expressions.
#include "pat_fwd.cuh"
#include "pat_merge.cuh"
