//! Time stamps in CPU cycles, as perftest takes them (`get_cycles`: `rdtsc`).
//!
//! A time stamp costs a few nanoseconds and no system call, which matters in
//! the soft-RoCE guest, whose clock source is the (slow, trapping) HPET. The
//! cycle rate is measured against the monotonic clock at start-up, so the
//! reported times are wall-clock times; perftest instead trusts the "cpu MHz"
//! line of /proc/cpuinfo, which the banner prints next to ours.

use std::time::{Duration, Instant};

/// Reads the time-stamp counter.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86_64 (it reads a counter).
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// Nanoseconds since the first call (no cycle counter on this architecture).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn now() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// How fast [`now`] ticks.
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    /// Ticks per microsecond (the CPU MHz for `rdtsc`).
    pub per_us: f64,
    /// /proc/cpuinfo's "cpu MHz", what perftest converts with (if readable).
    pub cpuinfo_mhz: Option<f64>,
}

impl Rate {
    /// Measures the tick rate over `window` of monotonic time.
    pub fn calibrate(window: Duration) -> Rate {
        let t0 = Instant::now();
        let c0 = now();
        while t0.elapsed() < window {
            std::thread::sleep(Duration::from_millis(5));
        }
        let c1 = now();
        let secs = t0.elapsed().as_secs_f64();
        let per_us = (c1.wrapping_sub(c0)) as f64 / secs / 1e6;
        Rate {
            per_us: if per_us.is_finite() && per_us > 0.0 {
                per_us
            } else {
                1000.0
            },
            cpuinfo_mhz: cpuinfo_mhz(),
        }
    }

    /// Ticks per second.
    pub fn per_sec(&self) -> f64 {
        self.per_us * 1e6
    }

    /// Ticks in `secs` seconds.
    pub fn ticks(&self, secs: f64) -> u64 {
        (secs * self.per_sec()) as u64
    }
}

/// The first "cpu MHz" of /proc/cpuinfo.
fn cpuinfo_mhz() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("cpu MHz"))?;
    line.split(':').nth(1)?.trim().parse().ok()
}

/// The phases of duration mode (perftest's `START_STATE` ... `END_STATE`):
/// warm up for `margin`, count for `duration - 2 margin`, cool down, stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Warming up: completions are not counted.
    Start,
    /// Counting.
    Sample,
    /// Cooling down: no longer counted.
    StopSample,
    /// Over: stop posting.
    End,
}

/// Duration-mode clock: checks the phase with one `rdtsc` per call.
#[derive(Debug, Clone, Copy)]
pub struct Timer {
    sample_at: u64,
    stop_at: u64,
    end_at: u64,
    /// The current phase.
    pub phase: Phase,
    /// When counting started (perftest's `tposted[0]`).
    pub sample_start: u64,
    /// When counting stopped (perftest's `tcompleted[0]`).
    pub sample_end: u64,
}

impl Timer {
    /// Starts the clock now.
    pub fn start(rate: &Rate, duration_s: u64, margin_s: f64) -> Timer {
        let t = now();
        let sample_at = t + rate.ticks(margin_s);
        let end_at = t + rate.ticks(duration_s as f64);
        let stop_at = end_at - rate.ticks(margin_s);
        Timer {
            sample_at,
            stop_at,
            end_at,
            phase: Phase::Start,
            sample_start: t,
            sample_end: t,
        }
    }

    /// Advances the phase; returns it.
    #[inline]
    pub fn tick(&mut self) -> Phase {
        if self.phase == Phase::End {
            return Phase::End;
        }
        let t = now();
        match self.phase {
            Phase::Start if t >= self.sample_at => {
                self.phase = Phase::Sample;
                self.sample_start = t;
            }
            Phase::Sample if t >= self.stop_at => {
                self.phase = Phase::StopSample;
                self.sample_end = t;
            }
            Phase::StopSample if t >= self.end_at => self.phase = Phase::End,
            _ => {}
        }
        self.phase
    }
}
