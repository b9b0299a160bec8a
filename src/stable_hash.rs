//! A 64-bit hash of a value that every process and every pass computes alike (SipHash-1-3 with
//! `std`'s fixed keys). For spreading work by name (resync slices, claim ranks, which waiting
//! machine a freed host wakes first) and for short keys standing for longer strings, where two
//! passes, or a test and a controller, must agree. Not for maps whose keys an outsider picks to
//! collide on purpose: those take a `RandomState` (as `controllers::events` does).

use std::hash::{DefaultHasher, Hash, Hasher};

/// The hash of `value`, the same in every process.
pub fn stable_hash<T: Hash + ?Sized>(value: &T) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::stable_hash;

    #[test]
    fn the_hash_depends_on_the_value_and_only_on_it() {
        assert_eq!(stable_hash(&("ns", "m-1")), stable_hash(&("ns", "m-1")));
        assert_ne!(stable_hash(&("ns", "m-1")), stable_hash(&("ns", "m-2")));
        // A tuple hashes its parts apart: moving a character across the boundary changes it.
        assert_ne!(stable_hash(&("ns", "m")), stable_hash(&("nsm", "")));
        assert_eq!(stable_hash("token"), stable_hash(&String::from("token")));
    }
}
