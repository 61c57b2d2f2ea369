//~ ERROR E0599 no method named `as_fd`
// The context's async event descriptor is not reachable from safe code: an
// event read from it is never acknowledged, and destroying the QP or CQ it
// names then waits forever. Event loops use `AsyncEvents::readiness()`.
use std::os::fd::AsFd;

use rdma_verbs::context::Context;

fn main() {
    let ctx = Context::open(None).unwrap();
    let events = ctx.async_events().unwrap();
    let _fd = events.as_fd();
}
