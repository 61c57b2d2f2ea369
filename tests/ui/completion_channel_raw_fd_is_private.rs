//~ ERROR E0599 no method named `as_raw_fd`
// Not as a raw descriptor either (see completion_channel_fd_is_private.rs).
use std::os::fd::AsRawFd;

use rdma_verbs::channel::CompletionChannel;
use rdma_verbs::context::Context;

fn main() {
    let ctx = Context::open(None).unwrap();
    let ch = CompletionChannel::new(&ctx).unwrap();
    let _fd = ch.as_raw_fd();
}
