//! A hostile guest on a vhost-user-blk disk: the input is the guest's memory
//! (its first 16 KiB: a split virtqueue's descriptor table at 0, available ring
//! at 0x1000, used ring at 0x2000, and the request headers, segments and data the
//! descriptors point at, anywhere), then the queue is served as a kick would
//! serve it, on a linear device of the fixture (the first byte picks the queue
//! size, a power of two up to 256; the second picks the zero device instead).
//!
//! Nothing may panic or wedge; every used entry names a descriptor of the queue
//! and the used index moves by no more than the available one did.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::export::vhost::blk::{serve_queue, BlkBackend};
use libfuzzer_sys::fuzz_target;
use vhost_user_backend::{VringRwLock, VringT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryMmap};

const MEM: usize = 64 << 10;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let size = 1u16 << (data[0] % 9);
    let name = if data[1] & 1 == 0 { "lin" } else { "z" };
    let Ok(dev) = common::registry().get(name) else {
        return;
    };
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]).expect("memory");
    let body = &data[2..data.len().min(2 + (16 << 10))];
    mem.write_slice(body, GuestAddress(0)).expect("fill");
    // the used ring starts as the guest leaves it: zero
    mem.write_slice(&[0u8; 4], GuestAddress(USED)).expect("used");
    let avail_idx: u16 = mem.read_obj(GuestAddress(AVAIL + 2)).expect("avail idx");
    let atomic = GuestMemoryAtomic::new(mem.clone());
    let vring = VringRwLock::new(atomic.clone(), 256).expect("vring");
    vring.set_queue_size(size);
    if vring.set_queue_info(DESC, AVAIL, USED).is_err() {
        return;
    }
    vring.set_queue_ready(true);
    let backend = BlkBackend::new(dev).expect("backend");
    let _ = serve_queue(&backend, &vring, &atomic);
    let used_idx: u16 = mem.read_obj(GuestAddress(USED + 2)).expect("used idx");
    assert!(
        used_idx <= avail_idx && used_idx <= size,
        "used index {used_idx} past the available {avail_idx} (queue of {size})"
    );
    for i in 0..u64::from(used_idx.min(size)) {
        let id: u32 = mem.read_obj(GuestAddress(USED + 4 + 8 * i)).expect("used id");
        assert!(
            id < u32::from(size),
            "used entry {i} names descriptor {id} of a queue of {size}"
        );
    }
});
