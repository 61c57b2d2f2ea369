//~ ERROR E0599 doesn't satisfy `EventChannel: AsFd`
// The rdma_cm event channel's descriptor is not reachable from safe code: an
// event read from it is never acknowledged, and rdma_destroy_id (the CmId's
// Drop) then waits forever. Event loops use `EventChannel::readiness()`.
use std::os::fd::AsFd;

use rdma_verbs::cm::CmId;

fn main() {
    let id = CmId::new().unwrap();
    let _fd = id.channel().as_fd();
}
