/* Headers bindgen reads; the generated static-inline shim includes this file too. */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
