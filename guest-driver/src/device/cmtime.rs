//! A connection-rate benchmark modelled on rdma-core's `cmtime`: a client opens N
//! connections to a server at once, then tears them all down, and reports per step the
//! total time of the step and the average, shortest and longest time per connection.
//!
//! Steps (what is timed per connection):
//! - `connect`: the `connect()` call (the REQ is built and queued);
//! - `establish`: from `connect()` until the connection is established (REP received,
//!   RTU sent) — rdma-core's "connect" step;
//! - `disconnect`: from `disconnect()` (DREQ) until the DREP came back;
//! - `destroy`: the `destroy()` call.
//!
//! A step's total runs from its first start to its last end, flushes to the device
//! included. Connections use simulated QPs from the port's QPN range (cmtime without
//! QPs); the service ID is rdma_cm's TCP one for the port and the REQ carries rdma_cm's
//! private-data header with a source port of its own (an ephemeral port per connection,
//! as rdma_cm binds an unbound id), so either side can be an rdma_cm peer.
//!
//! Every connection that is not established is a failure with its reason: the peer's
//! REJ (reason name and number), unreachable (the REQ's retries ran out), or a timeout
//! (no answer within the phase's time; the connection is then destroyed, which sends
//! REJ(TIMEOUT)). So `established + failed == connections` always, and a teardown that
//! did not complete in time is counted apart ([`Failure::DisconnectTimeout`]).
//!
//! The server listens on the port, accepts every request, answers each DREQ with a
//! DREP and destroys the connection; it stops after N connections were torn down.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use pvcm_wire::Gid;
use pvcm_wire::cm::RejReason;

use super::{Device, DeviceError, Notice, Transport};
use crate::cm::rdma_cm::{CmaHdr, EphemeralPorts, req_private_data, tcp_service_id};
use crate::cm::{CmId, ConnectOptions, Event, PacingCounters};
use crate::time::{Clock, Time};

/// cmtime's default port.
pub const DEFAULT_PORT: u16 = 7471;
/// cmtime's default number of connections.
pub const DEFAULT_CONNECTIONS: u32 = 100;

/// The client pumps the device after every this many `connect()` calls.
const PUMP_EVERY: usize = 16;

/// A timed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// The `connect()` calls.
    Connect,
    /// `connect()` until established.
    Establish,
    /// `disconnect()` until the DREP.
    Disconnect,
    /// The `destroy()` calls.
    Destroy,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 4] = [
        Step::Connect,
        Step::Establish,
        Step::Disconnect,
        Step::Destroy,
    ];

    /// The step's name.
    pub fn name(self) -> &'static str {
        match self {
            Step::Connect => "connect",
            Step::Establish => "establish",
            Step::Disconnect => "disconnect",
            Step::Destroy => "destroy",
        }
    }
}

/// Why a connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Failure {
    /// The peer rejected it: REJ with this reason.
    Rejected(RejReason),
    /// No answer after every retry (the agent's `Unreachable`).
    Unreachable,
    /// Not established within the time allowed (then destroyed: REJ(TIMEOUT)).
    Timeout,
    /// Established, but the DREP did not come within the time allowed.
    DisconnectTimeout,
}

impl Failure {
    /// The failure an event that ends a connection attempt means (`None`: established,
    /// or not an ending event); `None` for the event itself means the attempt timed out.
    pub fn of_attempt(ev: Option<&Event>) -> Option<Failure> {
        match ev {
            None => Some(Failure::Timeout),
            Some(Event::Rejected { reason, .. }) => Some(Failure::Rejected(*reason)),
            Some(Event::Unreachable { .. }) => Some(Failure::Unreachable),
            Some(_) => None,
        }
    }

    /// Short name: `rejected`, `unreachable`, `timeout`, `disconnect_timeout`.
    pub fn kind(self) -> &'static str {
        match self {
            Failure::Rejected(_) => "rejected",
            Failure::Unreachable => "unreachable",
            Failure::Timeout => "timeout",
            Failure::DisconnectTimeout => "disconnect_timeout",
        }
    }

    /// The REJ reason, for a rejection.
    pub fn rej_reason(self) -> Option<RejReason> {
        match self {
            Failure::Rejected(r) => Some(r),
            _ => None,
        }
    }
}

impl fmt::Display for Failure {
    /// `rejected invalid_service_id(8)`, `unreachable`, `timeout`, `disconnect_timeout`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Rejected(r) => write!(f, "rejected {r}"),
            other => f.write_str(other.kind()),
        }
    }
}

/// Times of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTimes {
    /// First start to last end.
    pub total: Duration,
    /// Sum of the per-connection times.
    pub sum: Duration,
    /// Shortest per-connection time.
    pub min: Duration,
    /// Longest per-connection time.
    pub max: Duration,
    /// Connections timed.
    pub count: u32,
}

impl Default for StepTimes {
    fn default() -> Self {
        StepTimes {
            total: Duration::ZERO,
            sum: Duration::ZERO,
            min: Duration::MAX,
            max: Duration::ZERO,
            count: 0,
        }
    }
}

impl StepTimes {
    /// Adds one connection's time.
    pub fn add(&mut self, d: Duration) {
        self.sum += d;
        self.min = self.min.min(d);
        self.max = self.max.max(d);
        self.count += 1;
    }

    /// Average per connection (zero if none).
    pub fn avg(&self) -> Duration {
        if self.count == 0 {
            Duration::ZERO
        } else {
            self.sum / self.count
        }
    }

    /// The shortest time, zero if none.
    pub fn min_or_zero(&self) -> Duration {
        if self.count == 0 {
            Duration::ZERO
        } else {
            self.min
        }
    }
}

/// What a client run measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmtimeReport {
    /// Connections attempted.
    pub connections: u32,
    /// Connections established.
    pub established: u32,
    /// Connections not established: rejected, unreachable or timed out
    /// (`established + failed == connections`).
    pub failed: u32,
    /// Connections whose teardown completed (DREP received).
    pub disconnected: u32,
    /// Every failure by reason, teardown timeouts included.
    pub failures: BTreeMap<Failure, u32>,
    /// Per step, in [`Step::ALL`] order.
    pub steps: [StepTimes; 4],
    /// The agent's pacing counters at the end of the run.
    pub pacing: PacingCounters,
}

impl CmtimeReport {
    /// The times of one step.
    pub fn step(&self, s: Step) -> &StepTimes {
        &self.steps[s as usize]
    }

    /// True when every connection was established and torn down.
    pub fn success(&self) -> bool {
        self.established == self.connections
            && self.disconnected == self.connections
            && self.failures.is_empty()
    }

    /// Failures of one kind ([`Failure::kind`]).
    pub fn failures_of(&self, kind: &str) -> u32 {
        self.failures
            .iter()
            .filter(|(f, _)| f.kind() == kind)
            .map(|(_, n)| n)
            .sum()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl fmt::Display for CmtimeReport {
    /// cmtime's table: step, total ms, and per connection avg/min/max us.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<12} {:>12} {:>12} {:>12} {:>12}",
            "step", "total ms", "avg us", "min us", "max us"
        )?;
        for s in Step::ALL {
            let t = self.step(s);
            writeln!(
                f,
                "{:<12} {:>12.2} {:>12.2} {:>12.2} {:>12.2}",
                s.name(),
                ms(t.total),
                us(t.avg()),
                us(t.min_or_zero()),
                us(t.max)
            )?;
        }
        write!(
            f,
            "connections {} established {} failed {} disconnected {}",
            self.connections, self.established, self.failed, self.disconnected
        )?;
        if !self.failures.is_empty() {
            write!(f, "\nfailures")?;
            for (why, n) in &self.failures {
                write!(f, " {why}: {n};")?;
            }
        }
        write!(f, "\n{}", self.pacing)
    }
}

/// Options of a client run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    /// The server's GID.
    pub dest: Gid,
    /// Its port (service ID `0x0000000001060000 | port`).
    pub port: u16,
    /// Connections.
    pub connections: u32,
    /// Time allowed for each of the establish and disconnect phases.
    pub timeout: Duration,
    /// Time to stay connected between the phases (the device keeps being served).
    pub hold: Duration,
    /// CM timeouts and path of every connection (rdma_cm's defaults, as rdma-core's
    /// cmtime, unless a test asks for others).
    pub connect: ConnectOptions,
}

/// Options of a server run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerOptions {
    /// The port to listen on.
    pub port: u16,
    /// Stop after this many connections were torn down.
    pub connections: u32,
    /// Give up after this long (`None`: never).
    pub timeout: Option<Duration>,
}

/// What a server run saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerReport {
    /// Connection requests accepted.
    pub accepted: u32,
    /// Connections established.
    pub established: u32,
    /// Connections torn down by the client.
    pub disconnected: u32,
    /// Connections that failed (rejected, unreachable, destroyed by the client early).
    pub failed: u32,
    /// Device resets seen.
    pub resets: u32,
}

impl fmt::Display for ServerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "accepted {} established {} disconnected {} failed {} resets {}",
            self.accepted, self.established, self.disconnected, self.failed, self.resets
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connecting,
    Established,
    Failed,
    Disconnecting,
    Disconnected,
}

/// One client burst: every connection's id, phase and start, the steps' times.
struct Burst {
    ids: Vec<CmId>,
    started: Vec<Time>,
    phase: Vec<Phase>,
    index: crate::cm::FastMap<CmId, usize>,
    steps: [StepTimes; 4],
    failures: BTreeMap<Failure, u32>,
    established: u32,
    disconnected: u32,
}

/// Runs the client side: `connections` connections to `dest`, all at once, then all
/// torn down. A connection that fails (REJ, unreachable) is counted and destroyed.
pub fn client<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    o: &ClientOptions,
) -> Result<CmtimeReport, DeviceError> {
    let n = o.connections as usize;
    let mut b = Burst {
        ids: Vec::with_capacity(n),
        started: Vec::with_capacity(n),
        phase: vec![Phase::Connecting; n],
        index: crate::cm::FastMap::with_capacity_and_hasher(n, Default::default()),
        steps: [StepTimes::default(); 4],
        failures: BTreeMap::new(),
        established: 0,
        disconnected: 0,
    };
    let t0 = dev.now();
    b.connect(dev, o)?;
    b.establish(dev, o, t0)?;
    if !o.hold.is_zero() {
        dev.run_until(o.hold, |_| false)?;
    }
    b.disconnect(dev, o)?;
    b.destroy(dev)?;
    // Let the last MADs (REJs of unfinished handshakes, DREQs) reach the device.
    dev.flush(Duration::from_secs(1))?;
    Ok(CmtimeReport {
        connections: o.connections,
        established: b.established,
        failed: b.failed(),
        disconnected: b.disconnected,
        failures: b.failures,
        steps: b.steps,
        pacing: dev.agent().pacing(),
    })
}

impl Burst {
    /// The connections that were not established.
    fn failed(&self) -> u32 {
        self.failures
            .iter()
            .filter(|(f, _)| **f != Failure::DisconnectTimeout)
            .map(|(_, n)| n)
            .sum()
    }

    /// The connect step: every connection started.
    fn connect<T: Transport, C: Clock>(
        &mut self,
        dev: &mut Device<T, C>,
        o: &ClientOptions,
    ) -> Result<(), DeviceError> {
        let sid = tcp_service_id(o.port);
        let local = dev.agent().config().gid;
        // rdma_cm binds each unbound id to an ephemeral source port (the flow label the
        // agent derives hashes it); past the range's size ports are shared.
        let mut ports = EphemeralPorts::new(dev.options().seed ^ 0x636d_7469_6d65);
        let t0 = dev.now();
        for i in 0..o.connections as usize {
            let s = dev.now();
            let src_port = ports.alloc().unwrap_or_else(|| ports.shared());
            let pd = req_private_data(&CmaHdr::from_gids(local, o.dest, src_port), &[])
                .map_err(|e| DeviceError::Invalid(format!("private data: {e}")))?;
            let id = dev.connect(o.dest, sid, &pd, &o.connect)?;
            self.steps[Step::Connect as usize].add(dev.now().since(s));
            self.ids.push(id);
            self.started.push(s);
            self.index.insert(id, i);
            // The REQs go out while the loop runs, as the kernel's rdma_connect() sends
            // at once: the peer starts answering instead of waiting for the whole loop
            // (1,000 connect() calls take ~25 ms in a TCG guest). Answers that come in
            // meanwhile wait in the agent's event queue for the establish step.
            if (i + 1) % PUMP_EVERY == 0 {
                dev.pump_now()?;
            }
        }
        dev.pump_now()?;
        self.steps[Step::Connect as usize].total = dev.now().since(t0);
        Ok(())
    }

    /// The establish step: waits for every connection's answer (from `t0`, the connect
    /// step's start); what is still connecting after `o.timeout` has timed out.
    fn establish<T: Transport, C: Clock>(
        &mut self,
        dev: &mut Device<T, C>,
        o: &ClientOptions,
        t0: Time,
    ) -> Result<(), DeviceError> {
        let mut last = t0;
        let mut pending = self.ids.len();
        dev.run_until(o.timeout, |d| {
            while let Some(ev) = d.pop_cm_event() {
                let Some(&i) = self.index.get(&ev.id()) else {
                    continue;
                };
                let now = d.now();
                match ev {
                    Event::Established { .. } if self.phase[i] == Phase::Connecting => {
                        self.phase[i] = Phase::Established;
                        self.steps[Step::Establish as usize].add(now.since(self.started[i]));
                        last = now;
                        self.established += 1;
                        pending -= 1;
                    }
                    Event::Rejected { .. } | Event::Unreachable { .. }
                        if self.phase[i] == Phase::Connecting =>
                    {
                        self.phase[i] = Phase::Failed;
                        if let Some(f) = Failure::of_attempt(Some(&ev)) {
                            *self.failures.entry(f).or_default() += 1;
                        }
                        pending -= 1;
                    }
                    _ => {}
                }
            }
            pending == 0
        })?;
        self.steps[Step::Establish as usize].total = last.since(t0);
        // Whatever is still connecting has timed out (destroyed later: REJ(TIMEOUT)).
        for p in self.phase.iter_mut().filter(|p| **p == Phase::Connecting) {
            *p = Phase::Failed;
            *self.failures.entry(Failure::Timeout).or_default() += 1;
        }
        Ok(())
    }

    /// The disconnect step: every established connection disconnected, its DREP
    /// awaited; those without one within `o.timeout` are counted apart.
    fn disconnect<T: Transport, C: Clock>(
        &mut self,
        dev: &mut Device<T, C>,
        o: &ClientOptions,
    ) -> Result<(), DeviceError> {
        let t1 = dev.now();
        let mut dis_start = vec![t1; self.ids.len()];
        let mut pending = 0usize;
        for (i, &id) in self.ids.iter().enumerate() {
            if self.phase[i] == Phase::Established {
                dis_start[i] = dev.now();
                dev.disconnect(id)?;
                self.phase[i] = Phase::Disconnecting;
                pending += 1;
            }
        }
        let mut last = t1;
        dev.run_until(o.timeout, |d| {
            while let Some(ev) = d.pop_cm_event() {
                let Some(&i) = self.index.get(&ev.id()) else {
                    continue;
                };
                if let Event::Disconnected { .. } = ev {
                    if self.phase[i] == Phase::Disconnecting {
                        let now = d.now();
                        self.phase[i] = Phase::Disconnected;
                        self.steps[Step::Disconnect as usize].add(now.since(dis_start[i]));
                        last = now;
                        self.disconnected += 1;
                        pending -= 1;
                    }
                }
            }
            pending == 0
        })?;
        self.steps[Step::Disconnect as usize].total = last.since(t1);
        let stuck = self
            .phase
            .iter()
            .filter(|p| **p == Phase::Disconnecting)
            .count() as u32;
        if stuck > 0 {
            self.failures.insert(Failure::DisconnectTimeout, stuck);
        }
        Ok(())
    }

    /// The destroy step, newest first: a connect still waiting for its window leaves
    /// the queue unsent, instead of being sent because an older one's destroy freed a
    /// slot.
    fn destroy<T: Transport, C: Clock>(
        &mut self,
        dev: &mut Device<T, C>,
    ) -> Result<(), DeviceError> {
        let t2 = dev.now();
        for id in self.ids.iter().rev() {
            let s = dev.now();
            dev.destroy(*id)?;
            self.steps[Step::Destroy as usize].add(dev.now().since(s));
        }
        dev.pump_now()?;
        self.steps[Step::Destroy as usize].total = dev.now().since(t2);
        Ok(())
    }
}

/// Runs the server side: listens on the port, then [`serve`]s.
pub fn server<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    o: &ServerOptions,
) -> Result<ServerReport, DeviceError> {
    let listen = dev.listen(tcp_service_id(o.port))?;
    serve(dev, listen, o)
}

/// Serves requests on `listen` (a listener on `o.port`'s service ID) until
/// `connections` connections were torn down by clients (or the timeout passed).
pub fn serve<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    listen: CmId,
    o: &ServerOptions,
) -> Result<ServerReport, DeviceError> {
    let mut listen = listen;
    let mut r = ServerReport::default();
    let want = o.connections;
    let mut err = None;
    let timeout = o.timeout.unwrap_or(Duration::MAX);
    dev.run_until(timeout, |d| {
        while let Some(n) = d.pop_notice() {
            let res = match n {
                Notice::Device(super::DeviceEvent::Reset) => {
                    r.resets += 1;
                    // The listener went with the agent.
                    d.listen(tcp_service_id(o.port)).map(|id| listen = id)
                }
                Notice::Device(_) => Ok(()),
                Notice::Cm(Event::ConnectRequest { id, listen_id, .. }) if listen_id == listen => {
                    r.accepted += 1;
                    d.accept(id, &[])
                }
                Notice::Cm(Event::Established { .. }) => {
                    r.established += 1;
                    Ok(())
                }
                Notice::Cm(Event::Disconnected { id }) => {
                    r.disconnected += 1;
                    // DREP, then TimeWait in the agent.
                    d.destroy(id)
                }
                Notice::Cm(Event::Rejected { id, .. } | Event::Unreachable { id }) => {
                    r.failed += 1;
                    d.destroy(id)
                }
                Notice::Cm(_) => Ok(()),
            };
            if let Err(e) = res {
                err = Some(e);
                return true;
            }
        }
        r.disconnected + r.failed >= want
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    dev.flush(Duration::from_secs(1))?;
    Ok(r)
}
