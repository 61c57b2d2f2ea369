//~ ERROR E0521 borrowed data escapes outside of closure
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::qp::{Qp, Rc, Rts};
use rdma_verbs::qp::scope::ScopedQp;

// A scoped QP used after its scope could post buffers nobody waits for.
fn f<'a>(
    cq: &'a mut Cq,
    qp: &'a mut Qp<Rc, Rts>,
    keep: &mut Option<ScopedQp<'a, Rts>>,
) -> Result<()> {
    cq.scope(|s| {
        *keep = Some(s.attach(qp)?);
        Ok(())
    })
}
fn main() {}
