//! The device worker's wire protocol: fixed-size request and reply headers on the control socket, with bulk data in the shared region.
//!
//! A request is a [`RequestHeader`] followed by `payload_len` bytes (a launch's arguments, an
//! open's library path and config). Launches and writes get no reply: the worker runs them in
//! order and keeps the first failure, which the next request that has a reply reports, so a
//! step's hundreds of launches cost one socket write. Every other request gets a
//! [`ReplyHeader`] followed by `payload_len` bytes (callable names, stats, an error message).
//! All integers are little-endian.
//!
//! A copy out in the background (device table revision 1.2) lands in a second shared region,
//! the copy-out region, which the host maps once with [`Op::MapCopyRegion`] and the launch
//! traffic never touches: [`Op::CopyOutStart`] returns at once, launches go on, and the host
//! reads the region only after an [`Op::CopyOutPoll`] reply said the copy ended. The open reply's
//! `value` is 1 when the device has the copy-out entries.

use std::io::{self, Read, Write};

use plughost_device_abi::{DeviceStats, MAX_RANK, TensorArg};

/// What a request asks the worker to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Payload: the library path, a NUL, the device config. Reply: the callable names.
    Open,
    /// `a`: bytes. Reply `value`: the buffer id.
    Alloc,
    /// `a`: the buffer id.
    Free,
    /// Copy `c` bytes from the shared region at `d` into buffer `a` at offset `b`. No reply.
    Write,
    /// Copy `c` bytes of buffer `a` at offset `b` into the shared region at 0. Reply payload:
    /// the counters of [`DeviceStats`] after it.
    Read,
    /// Callable `a` with `count` tensor arguments and `b` params in the payload. No reply.
    Launch,
    /// Reply `value`: device nanoseconds since the previous synchronize; payload: the
    /// counters of [`DeviceStats`], then [`ReplyCounters::push_callable_times`]'s.
    Synchronize,
    /// Reply payload: the counters of [`DeviceStats`].
    Stats,
    /// `a`: the callable. Reply `value`: its successful launches.
    CallableLaunches,
    /// Nothing to do: reports the failure of an earlier launch or write, if any.
    Barrier,
    /// Close the device and exit. No reply.
    Close,
    /// Copy the `count` byte ranges of the payload ([`encode_range`]), in order, into the
    /// shared region from 0 on. Reply payload: the counters of [`DeviceStats`] after it.
    ReadRanges,
    /// Copy the region's bytes from `d` on, in order, into the `count` byte ranges of the
    /// payload. No reply.
    WriteRanges,
    /// Reply payload: [`ReplyCounters::push_callable_times`]'s.
    CallableDeviceNs,
    /// Only ever a reply, sent unasked while a batch of launches runs, at most every
    /// [`PROGRESS_EVERY`] and only after a launch completed: the host's timeout then measures
    /// a launch, not a whole step, so a long step that keeps launching is not taken for a hang.
    /// `value`: launches completed since the worker started. No payload.
    Progress,
    /// Map the host's copy-out region: payload its path, `a` its length in bytes. Reply.
    MapCopyRegion,
    /// Start copying the `count` byte ranges of the payload, in order, into the copy-out region
    /// from 0 on, in the background (device table revision 1.2). Reply at once.
    CopyOutStart,
    /// Reply `value`: 1 once the copy out in flight has ended (its bytes are in the copy-out
    /// region), 0 while it runs; with `a` nonzero, the reply waits for its end.
    CopyOutPoll,
    /// [`Op::Synchronize`], then [`Op::Read`]'s copy of `c` bytes of buffer `a` at offset `b`
    /// into the region at 0: the end of a step in one round trip. Reply as `Synchronize`'s.
    SynchronizeRead,
}

/// The least time between two [`Op::Progress`] replies.
pub const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

impl Op {
    const ALL: [Op; 19] = [
        Op::Open,
        Op::Alloc,
        Op::Free,
        Op::Write,
        Op::Read,
        Op::Launch,
        Op::Synchronize,
        Op::Stats,
        Op::CallableLaunches,
        Op::Barrier,
        Op::Close,
        Op::ReadRanges,
        Op::WriteRanges,
        Op::CallableDeviceNs,
        Op::Progress,
        Op::MapCopyRegion,
        Op::CopyOutStart,
        Op::CopyOutPoll,
        Op::SynchronizeRead,
    ];

    fn code(self) -> u32 {
        Op::ALL.iter().position(|&op| op == self).unwrap_or(0) as u32 + 1
    }

    fn from_code(code: u32) -> Option<Op> {
        Op::ALL.get((code as usize).checked_sub(1)?).copied()
    }

    /// The device operation's name, as a [`DeviceError`](crate::device::DeviceError) names it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Open => "open",
            Op::Alloc => "alloc",
            Op::Free => "free",
            Op::Write => "write",
            Op::Read => "read",
            Op::Launch => "launch",
            Op::Synchronize => "synchronize",
            Op::Stats => "stats",
            Op::CallableLaunches => "callable_launches",
            Op::Barrier => "barrier",
            Op::Close => "close",
            Op::ReadRanges => "read_ranges",
            Op::WriteRanges => "write_ranges",
            Op::CallableDeviceNs => "callable_device_ns",
            Op::Progress => "progress",
            Op::MapCopyRegion => "map_copy_region",
            Op::CopyOutStart => "copy_out_start",
            Op::CopyOutPoll => "copy_out_poll",
            Op::SynchronizeRead => "synchronize_read",
        }
    }
}

/// A request's fixed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub op: Op,
    pub count: u32,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub payload_len: u64,
}

pub const REQUEST_HEADER_BYTES: usize = 48;

impl RequestHeader {
    pub fn new(op: Op) -> RequestHeader {
        RequestHeader {
            op,
            count: 0,
            a: 0,
            b: 0,
            c: 0,
            d: 0,
            payload_len: 0,
        }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.op.code().to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        for word in [self.a, self.b, self.c, self.d, self.payload_len] {
            out.extend_from_slice(&word.to_le_bytes());
        }
    }

    pub fn read(reader: &mut impl Read) -> io::Result<RequestHeader> {
        let mut bytes = [0u8; REQUEST_HEADER_BYTES];
        reader.read_exact(&mut bytes)?;
        let mut fields = Fields(&bytes);
        let code = fields.u32();
        let op = Op::from_code(code).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown device worker request {code}"),
            )
        })?;
        Ok(RequestHeader {
            op,
            count: fields.u32(),
            a: fields.u64(),
            b: fields.u64(),
            c: fields.u64(),
            d: fields.u64(),
            payload_len: fields.u64(),
        })
    }
}

/// A reply's fixed part: the status of the request (or of the earlier launch or write that
/// failed, named by `op`), a value, and the length of the payload that follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyHeader {
    pub status: i32,
    pub op: Op,
    pub value: u64,
    pub payload_len: u64,
}

pub const REPLY_HEADER_BYTES: usize = 24;

impl ReplyHeader {
    /// Writes the header and `payload` and flushes; give it a buffered writer, so a reply is
    /// one system call.
    pub fn write(&self, writer: &mut impl Write, payload: &[u8]) -> io::Result<()> {
        writer.write_all(&self.status.to_le_bytes())?;
        writer.write_all(&self.op.code().to_le_bytes())?;
        writer.write_all(&self.value.to_le_bytes())?;
        writer.write_all(&(payload.len() as u64).to_le_bytes())?;
        writer.write_all(payload)?;
        writer.flush()
    }

    pub fn read(reader: &mut impl Read) -> io::Result<ReplyHeader> {
        let mut bytes = [0u8; REPLY_HEADER_BYTES];
        reader.read_exact(&mut bytes)?;
        let mut fields = Fields(&bytes);
        let status = fields.u32() as i32;
        let code = fields.u32();
        let op = Op::from_code(code).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown device worker reply {code}"),
            )
        })?;
        Ok(ReplyHeader {
            status,
            op,
            value: fields.u64(),
            payload_len: fields.u64(),
        })
    }
}

/// Bytes of one tensor argument on the wire.
pub const TENSOR_ARG_BYTES: usize = 8 + 8 + 4 + 4 + 8 * MAX_RANK + 4;

pub fn encode_tensor_arg(arg: &TensorArg, out: &mut Vec<u8>) {
    out.extend_from_slice(&arg.buffer.to_le_bytes());
    out.extend_from_slice(&arg.offset.to_le_bytes());
    out.extend_from_slice(&arg.dtype.to_le_bytes());
    out.extend_from_slice(&arg.ndim.to_le_bytes());
    for dim in arg.shape {
        out.extend_from_slice(&dim.to_le_bytes());
    }
    out.extend_from_slice(&arg.tag.to_le_bytes());
}

/// The tensor argument at the start of `bytes`, which holds at least [`TENSOR_ARG_BYTES`].
pub fn decode_tensor_arg(bytes: &[u8]) -> TensorArg {
    let mut fields = Fields(bytes);
    let buffer = fields.u64();
    let offset = fields.u64();
    let dtype = fields.u32();
    let ndim = fields.u32();
    let mut shape = [0u64; MAX_RANK];
    for dim in &mut shape {
        *dim = fields.u64();
    }
    TensorArg {
        buffer,
        offset,
        dtype,
        ndim,
        shape,
        tag: fields.u32(),
    }
}

/// Bytes of one byte range (buffer, offset, length) on the wire.
pub const RANGE_BYTES: usize = 3 * 8;

pub fn encode_range(buffer: u64, offset: u64, len: u64, out: &mut Vec<u8>) {
    for word in [buffer, offset, len] {
        out.extend_from_slice(&word.to_le_bytes());
    }
}

/// The (buffer, offset, length) at the start of `bytes`, which holds at least [`RANGE_BYTES`].
pub fn decode_range(bytes: &[u8]) -> (u64, u64, u64) {
    let mut fields = Fields(bytes);
    (fields.u64(), fields.u64(), fields.u64())
}

/// Bytes of the device counters on the wire.
pub const STATS_BYTES: usize = 9 * 8;

pub fn encode_stats(stats: &DeviceStats) -> [u8; STATS_BYTES] {
    let mut out = [0u8; STATS_BYTES];
    for (chunk, value) in out.chunks_exact_mut(8).zip(stats_fields(stats)) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
    out
}

pub fn decode_stats(bytes: &[u8]) -> Option<DeviceStats> {
    if bytes.len() < STATS_BYTES {
        return None;
    }
    let mut fields = Fields(bytes);
    Some(DeviceStats {
        allocations: fields.u64(),
        frees: fields.u64(),
        live_allocations: fields.u64(),
        live_bytes: fields.u64(),
        h2d_bytes: fields.u64(),
        h2d_calls: fields.u64(),
        d2h_bytes: fields.u64(),
        d2h_calls: fields.u64(),
        launches: fields.u64(),
    })
}

fn stats_fields(stats: &DeviceStats) -> [u64; 9] {
    [
        stats.allocations,
        stats.frees,
        stats.live_allocations,
        stats.live_bytes,
        stats.h2d_bytes,
        stats.h2d_calls,
        stats.d2h_bytes,
        stats.d2h_calls,
        stats.launches,
    ]
}

/// The most callables whose device times a reply carries.
pub const MAX_TIMED_CALLABLES: usize = 64;

/// The counters and callable times a reply carries, on the stack.
pub struct ReplyCounters {
    bytes: [u8; STATS_BYTES + 8 * MAX_TIMED_CALLABLES],
    len: usize,
}

impl ReplyCounters {
    pub fn new() -> Self {
        ReplyCounters {
            bytes: [0; STATS_BYTES + 8 * MAX_TIMED_CALLABLES],
            len: 0,
        }
    }

    pub fn push_stats(&mut self, stats: &DeviceStats) {
        self.push(&encode_stats(stats));
    }

    /// Appends each callable's device nanoseconds, at most [`MAX_TIMED_CALLABLES`]; nothing
    /// for a device that does not report them (`None`).
    pub fn push_callable_times(&mut self, times: Option<&[u64]>) {
        for ns in times.unwrap_or(&[]).iter().take(MAX_TIMED_CALLABLES) {
            self.push(&ns.to_le_bytes());
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let end = (self.len + bytes.len()).min(self.bytes.len());
        self.bytes[self.len..end].copy_from_slice(&bytes[..end - self.len]);
        self.len = end;
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Each callable's device nanoseconds from a reply's callable-times section into `out`;
/// false when the section is empty: the device does not report them.
pub fn decode_callable_times(bytes: &[u8], out: &mut Vec<u64>) -> bool {
    out.clear();
    let mut fields = Fields(bytes);
    out.extend((0..bytes.len() / 8).map(|_| fields.u64()));
    !out.is_empty()
}

/// Reads little-endian integers from the front of a slice whose length the caller checked.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

#[cfg(test)]
mod tests {
    use plughost_device_abi::{ArgTag, DType};

    use super::*;

    #[test]
    fn headers_and_arguments_survive_the_wire() {
        let header = RequestHeader {
            op: Op::Launch,
            count: 3,
            a: 7,
            b: u64::MAX,
            c: 1 << 40,
            d: 5,
            payload_len: 99,
        };
        let mut bytes = Vec::new();
        header.encode(&mut bytes);
        assert_eq!(bytes.len(), REQUEST_HEADER_BYTES);
        assert_eq!(RequestHeader::read(&mut bytes.as_slice()).unwrap(), header);

        let arg = TensorArg::new(11, 64, DType::BF16, &[2, 3, 4], ArgTag::Inout).unwrap();
        let mut bytes = Vec::new();
        encode_tensor_arg(&arg, &mut bytes);
        assert_eq!(bytes.len(), TENSOR_ARG_BYTES);
        let back = decode_tensor_arg(&bytes);
        assert_eq!(
            (
                back.buffer,
                back.offset,
                back.dtype,
                back.ndim,
                back.shape,
                back.tag
            ),
            (
                arg.buffer, arg.offset, arg.dtype, arg.ndim, arg.shape, arg.tag
            )
        );

        let reply = ReplyHeader {
            status: -4,
            op: Op::Launch,
            value: 12,
            payload_len: 2,
        };
        let mut bytes = Vec::new();
        reply.write(&mut bytes, b"no").unwrap();
        assert_eq!(ReplyHeader::read(&mut bytes.as_slice()).unwrap(), reply);
        assert_eq!(&bytes[REPLY_HEADER_BYTES..], b"no");
    }

    #[test]
    fn ranges_survive_the_wire() {
        let mut bytes = Vec::new();
        encode_range(3, 1 << 33, 4096, &mut bytes);
        assert_eq!(bytes.len(), RANGE_BYTES);
        assert_eq!(decode_range(&bytes), (3, 1 << 33, 4096));
        for op in Op::ALL {
            assert_eq!(Op::from_code(op.code()), Some(op), "{}", op.name());
        }
    }

    #[test]
    fn an_unknown_request_is_an_error_not_a_guess() {
        let mut bytes = vec![0u8; REQUEST_HEADER_BYTES];
        bytes[0] = 200;
        let error = RequestHeader::read(&mut bytes.as_slice()).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn counters_and_callable_times_share_a_reply() {
        let stats = DeviceStats {
            launches: 3,
            ..Default::default()
        };
        let mut counters = ReplyCounters::new();
        counters.push_stats(&stats);
        counters.push_callable_times(Some(&[7, 0, u64::MAX]));
        let bytes = counters.as_bytes();
        assert_eq!(decode_stats(bytes).map(|s| s.launches), Some(3));
        let mut times = vec![1];
        assert!(decode_callable_times(&bytes[STATS_BYTES..], &mut times));
        assert_eq!(times, [7, 0, u64::MAX]);
        // A device that does not time its callables sends none.
        let mut counters = ReplyCounters::new();
        counters.push_stats(&stats);
        counters.push_callable_times(None);
        assert!(!decode_callable_times(
            &counters.as_bytes()[STATS_BYTES..],
            &mut times
        ));
        assert!(times.is_empty());
        // More callables than a reply carries are cut at the limit, never past the buffer.
        let mut counters = ReplyCounters::new();
        counters.push_callable_times(Some(&[1; MAX_TIMED_CALLABLES + 5]));
        assert!(decode_callable_times(counters.as_bytes(), &mut times));
        assert_eq!(times.len(), MAX_TIMED_CALLABLES);
    }

    #[test]
    fn stats_round_trip() {
        let stats = DeviceStats {
            allocations: 1,
            frees: 2,
            live_allocations: 3,
            live_bytes: 4,
            h2d_bytes: 5,
            h2d_calls: 6,
            d2h_bytes: 7,
            d2h_calls: 8,
            launches: 9,
        };
        let back = decode_stats(&encode_stats(&stats)).unwrap();
        assert_eq!(stats_fields(&back), stats_fields(&stats));
    }
}
