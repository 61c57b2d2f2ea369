//~ ERROR E0499 more than once at a time
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::Mr;
use rdma_verbs::qp::{Qp, Rc, Rts};

// The region of a scope's buffers is lent until the scope ends.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mut mr: Mr) -> Result<()> {
    cq.scope(|s| {
        let q = s.attach(qp)?;
        let mut rx = q.buffers(&mut mr, 64)?;
        rx.post_recv(0, 0)?;
        drop(rx);
        mr.fill(0)?;
        Ok(())
    })
}
fn main() {}
