//~ ERROR E0599 no method named `as_fd`
// The completion channel's descriptor is not reachable from safe code: a
// read(2) on it would consume an event behind libibverbs' back and make the
// CQ's Drop (ibv_destroy_cq) wait forever. Event loops use `readiness()`.
use std::os::fd::AsFd;

use rdma_verbs::channel::CompletionChannel;
use rdma_verbs::context::Context;

fn main() {
    let ctx = Context::open(None).unwrap();
    let ch = CompletionChannel::new(&ctx).unwrap();
    let _fd = ch.as_fd();
}
