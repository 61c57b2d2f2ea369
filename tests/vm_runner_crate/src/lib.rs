//! The smallest user of rdma-verbs: the name and state of the device's first port.

use rdma_verbs::context::Context;
use rdma_verbs::device::PortState;

/// The device's name and the state of its port 1.
pub fn port_state(device: Option<&str>) -> rdma_verbs::Result<(String, PortState)> {
    let ctx = Context::open(device)?;
    let port = ctx.query_port(1)?;
    Ok((ctx.name().to_owned(), port.state))
}
