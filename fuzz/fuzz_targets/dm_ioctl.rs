//! The dm ioctl door: an ioctl request number (the first 4 bytes, little-endian,
//! XOR DM_VERSION's, so zero bytes are device-mapper's own commands) and the
//! caller's buffer (the rest; see below for bit 16), decoded and run against
//! the registry as the daemon runs them. A DEV_WAIT returns at once (its caller counts as gone).
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, buf)) = data.split_first_chunk::<4>() else {
        return;
    };
    let request = u32::from_le_bytes(*head) ^ 0xc138_fd00;
    let ctx = common::ctx();
    // with bit 16 of the request number set (the size bits, which name no
    // command), the frame carries the header alone of a buffer twice as long,
    // as the door's library carries the buffers of commands that read no data
    let (raw, len) = if request & (1 << 16) != 0 {
        (
            buf.get(..dmkit::control::dmioctl::HEADER_SIZE).unwrap_or(buf),
            buf.len() * 2,
        )
    } else {
        (buf, buf.len())
    };
    let (errno, out, _) = dmkit::control::door::ioctl(ctx, request, raw.to_vec(), len, "", &|| true);
    // the reply never grows the caller's buffer
    assert!(out.len() <= len.max(12), "{} bytes back for {}", out.len(), len);
    assert!(errno >= 0);
    // devices the inputs made: removed once there are many, so the registry
    // (shared by every input) stays small and runs stay fast
    common::trim_registry(ctx);
});
