//~ ERROR E0499 more than once at a time
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rc, Rts};
use rdma_verbs::qp::scope::{Dst, ScopedSend};

// The NIC may write a lent destination until the scope ends: no Rust access.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mut mr: Mr, remote: RemoteMr) -> Result<()> {
    cq.scope(|s| {
        let mut q = s.attach(qp)?;
        let dst = Dst::new(&mut mr)?;
        q.post_send(&ScopedSend::read(1, dst, remote, 0))?;
        mr.fill(0)?;
        Ok(())
    })
}
fn main() {}
