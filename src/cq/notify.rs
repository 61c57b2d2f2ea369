//! A CQ on a completion channel: arming it, acknowledging its events, and
//! sleeping until it has completions.

use std::time::{Duration, Instant};

use super::{Completion, Cq};
use crate::channel::{ACK_BATCH, CompletionChannel, CqEvents, CqId, WAIT_SLICE, deadline_after};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::call::verb;

impl Cq {
    /// Creates a CQ whose completion events go to `channel`
    /// (`ibv_create_cq` with a channel, completion vector 0).
    ///
    /// The CQ keeps the channel alive; arm it with [`req_notify`](Cq::req_notify)
    /// or let [`wait_poll`](Cq::wait_poll) do so.
    #[doc(alias = "ibv_create_cq")]
    pub fn with_channel(ctx: &Context, depth: u32, channel: &CompletionChannel) -> Result<Cq> {
        // The raw context, as QPs and SRQs compare: two `Context` values can
        // share one (`CmId::context` makes a new one each call).
        if ctx.as_raw() != channel.inner.context().as_raw() {
            return Err(Error::InvalidArgument {
                what: "completion channel",
                reason: "it belongs to another device context; create it from the same Context"
                    .into(),
            });
        }
        let cq = Cq::create(ctx, depth, Some(channel))?;
        // No event can arrive before this: the CQ is not armed yet.
        if let Some(events) = &cq.inner.events {
            channel.inner.register(cq.as_raw(), events);
        }
        Ok(cq)
    }

    /// This CQ's id, as [`CompletionChannel::wait`] and async events name it.
    pub fn id(&self) -> CqId {
        CqId::from_raw(self.as_raw())
    }

    /// The channel the CQ reports to, if any.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// Arms the CQ (`ibv_req_notify_cq`): the next completion (with
    /// `solicited_only`, the next solicited or error completion) raises one
    /// event on the channel. Completions already in the CQ raise none: poll
    /// after arming (see [`wait_poll`](Cq::wait_poll)).
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let Some(channel) = self.inner.channel.as_ref() else {
            return Err(no_channel());
        };
        // Arms of one CQ from several threads (`&Cq` is shared) and the
        // channel's event reads update the provider's arm state: one at a time.
        let _arm = channel.inner.arm_lock();
        // SAFETY: valid CQ; no other arm or event read of its channel runs.
        verb!(rc: unsafe { ffi::ibv_req_notify_cq(self.as_raw(), i32::from(solicited_only)) })?;
        Ok(())
    }

    /// Acknowledges the events counted on this CQ so far (`ibv_ack_cq_events`),
    /// returning how many. Optional: [`wait_poll`](Cq::wait_poll) and `Drop` do it.
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn ack_events(&mut self) -> u32 {
        let Some(events) = self.inner.events.as_deref() else {
            return 0;
        };
        let n = events.take();
        if n > 0 {
            // SAFETY: valid CQ (&mut self); n events were read and not yet acked.
            unsafe { ffi::ibv_ack_cq_events(self.as_raw(), n) };
        }
        n
    }

    /// Events read from the channel for this CQ and not yet acknowledged.
    pub fn unacked_events(&self) -> u32 {
        self.inner.events.as_deref().map_or(0, CqEvents::pending)
    }

    /// Polls (`ibv_poll_cq`), and arms the CQ and sleeps on the channel
    /// (`ibv_req_notify_cq`, `ibv_get_cq_event`) while it is empty, until at least
    /// one completion is in `out` or `timeout` (`None`: forever) has passed.
    /// Returns how many completions were added; `0` only on timeout.
    ///
    /// The loop: poll; if empty, arm ([`req_notify`](Cq::req_notify)), poll
    /// again (a completion that slipped in before the arm raised no event),
    /// then sleep on the channel and start over; events are acknowledged in
    /// batches of [`ACK_BATCH`]. Like [`poll`](Cq::poll) it fills `out` up to its
    /// capacity (it reserves room when `out` is full).
    ///
    /// It never sleeps longer than [`WAIT_SLICE`] without polling: should
    /// another clone of the channel consume this CQ's event, the completion
    /// is found then.
    ///
    /// The channel must serve this CQ alone: a waiter on a shared channel
    /// could consume the event meant for another CQ's waiter. With several CQs
    /// on one channel, use [`CompletionChannel::wait`] and poll the CQ it names.
    /// A CQ attached to the channel while this waits ends the wait with that
    /// error too, at the latest when the wait reads an event (counted on the
    /// CQ it names, whose waiter then finds the completion by polling).
    #[doc(alias("ibv_poll_cq", "ibv_req_notify_cq", "ibv_get_cq_event"))]
    pub fn wait_poll(
        &mut self,
        out: &mut Vec<Completion>,
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let Some(channel) = self.inner.channel.clone() else {
            return Err(no_channel());
        };
        refuse_shared(&channel)?;
        if out.len() == out.capacity() {
            out.reserve(32);
        }
        let deadline = timeout.map(deadline_after);
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            self.req_notify(false)?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(0);
            }
            // In slices, polling between them: another clone of the channel
            // (a monitor calling `try_next`, say) may take this CQ's event,
            // and the completion must not wait for the next one.
            let slice = left.map_or(WAIT_SLICE, |l| l.min(WAIT_SLICE));
            refuse_shared(&channel)?;
            match channel.wait(Some(slice))? {
                None if left.is_some_and(|l| l <= WAIT_SLICE) => {
                    // Timed out; one last look, in case a completion raced the clock.
                    return self.poll(out);
                }
                None => continue,
                // Another CQ's event: the channel is shared now.
                Some(id) if id != self.id() => refuse_shared(&channel)?,
                Some(_) => {}
            }
            if self.unacked_events() >= ACK_BATCH {
                self.ack_events();
            }
        }
    }
}

/// Refuses a channel that serves more CQs than the one waiting on it.
fn refuse_shared(channel: &CompletionChannel) -> Result<()> {
    let cqs = channel.attached_cqs();
    if cqs > 1 {
        return Err(Error::InvalidArgument {
            what: "completion channel",
            reason: format!(
                "wait_poll needs a channel of its own, this one serves {cqs} CQs; \
                 use CompletionChannel::wait and poll the CQ it names"
            ),
        });
    }
    Ok(())
}

fn no_channel() -> Error {
    Error::InvalidArgument {
        what: "CQ",
        reason: "this CQ has no completion channel; create it with Cq::with_channel".into(),
    }
}
