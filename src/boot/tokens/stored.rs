//! A boot Secret as the stores keep it: one per host, read on every boot request and every
//! pass of its MetalMachine and MetalHost.
//!
//! A `Secret` keeps its annotations and data in two B-tree maps, each at least one node of
//! 640 bytes however few entries it has, and every key a heap string. Here they are two boxed
//! slices sorted by key, whose well-known keys are static strings, not copies. The bootstrap data
//! and the labels are not kept (see [`StoredBootSecret::from`]). About 1.4 KB less per host, which
//! is 14 MB at 10,000 hosts.

use std::borrow::Cow;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// A key of an annotation or data entry: one of [`super::KNOWN_KEYS`] borrowed, any other owned.
type Key = Cow<'static, str>;

fn key(name: String) -> Key {
    match super::KNOWN_KEYS.iter().find(|known| **known == name) {
        Some(known) => Cow::Borrowed(known),
        None => Cow::Owned(name),
    }
}

/// A boot Secret without its labels, its managed fields and its bootstrap data.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredBootSecret {
    /// Name, namespace, uid, resourceVersion, owner: no labels, annotations or managedFields.
    pub metadata: ObjectMeta,
    annotations: Box<[(Key, Box<str>)]>,
    data: Box<[(Key, Box<[u8]>)]>,
}

impl StoredBootSecret {
    /// The annotation `key`, if present.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        find(&self.annotations, key).map(|v| &**v)
    }

    /// The data entry `key`, if present.
    pub fn datum(&self, key: &str) -> Option<&[u8]> {
        find(&self.data, key).map(|v| &**v)
    }

    /// The Secret this was kept from, as far as it was kept: what renewals patch from (they
    /// change annotations and data only, and leave keys it lacks alone on the server).
    pub fn to_secret(&self) -> Secret {
        let annotations = (!self.annotations.is_empty()).then(|| {
            self.annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        });
        let data = (!self.data.is_empty()).then(|| {
            self.data
                .iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
                .collect()
        });
        Secret {
            metadata: ObjectMeta {
                annotations,
                ..self.metadata.clone()
            },
            data,
            type_: Some(super::BOOT_SECRET_TYPE.to_string()),
            ..Default::default()
        }
    }
}

/// Binary search in a slice sorted by key (the maps it came from were).
fn find<'a, V>(entries: &'a [(Key, V)], key: &str) -> Option<&'a V> {
    entries
        .binary_search_by(|(k, _)| (**k).cmp(key))
        .ok()
        .map(|at| &entries[at].1)
}

impl From<Secret> for StoredBootSecret {
    /// Keeps everything but the bootstrap data, which is read from the apiserver when a host
    /// asks for it (`user_data`), once per boot: at N hosts the store would otherwise hold N
    /// copies of bootstrap data (5.9 KB each in the scale bench, tens of KB for a kubeadm control
    /// plane) that nothing but that one request reads. Nor the labels: the watch selects boot
    /// Secrets by label, so every one has it, and no reader looks at them (renewals patch only
    /// annotations and data; a cleaning attempt's replace writes a Secret built anew).
    fn from(secret: Secret) -> Self {
        let mut metadata = secret.metadata;
        let annotations = metadata
            .annotations
            .take()
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (key(k), v.into_boxed_str()))
            .collect();
        metadata.labels = None;
        metadata.managed_fields = None;
        let data = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| k != super::KEY_USER_DATA)
            .map(|(k, v)| (key(k), v.0.into_boxed_slice()))
            .collect();
        StoredBootSecret {
            metadata,
            annotations,
            data,
        }
    }
}

impl From<&Secret> for StoredBootSecret {
    fn from(secret: &Secret) -> Self {
        secret.clone().into()
    }
}

/// Read as a `Secret` and kept as above: what the watch of boot Secrets decodes into.
impl<'de> serde::Deserialize<'de> for StoredBootSecret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Secret::deserialize(deserializer).map(Self::from)
    }
}

impl k8s_openapi::Resource for StoredBootSecret {
    const API_VERSION: &'static str = <Secret as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Secret as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Secret as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Secret as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Secret as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Secret as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for StoredBootSecret {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the watch decodes is what `From` keeps: labels, managed fields and bootstrap data
    /// gone, every other annotation and datum found by key (well-known or not), and the Secret
    /// given back for a renewal holds them all again.
    #[test]
    fn the_watch_keeps_every_annotation_and_datum_but_the_bootstrap_data() {
        let json = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "m1-boot",
                "namespace": "ns",
                "resourceVersion": "7",
                "labels": {"metalboot.io/boot-token": "true"},
                "annotations": {"metalboot.io/host": "h1", "zz.example/other": "kept"},
                "managedFields": [{"manager": "metalboot"}],
            },
            "type": "metalboot.io/boot-token",
            // "token" and "user-data", base64.
            "data": {"token": "dG9rZW4=", "user-data": "I2Nsb3VkLWNvbmZpZw==", "x-extra": "eA=="},
        });
        let stored: StoredBootSecret = serde_json::from_value(json.clone()).expect("decodes");
        assert_eq!(stored.metadata.labels, None);
        assert_eq!(stored.metadata.managed_fields, None);
        assert_eq!(stored.annotation("metalboot.io/host"), Some("h1"));
        assert_eq!(stored.annotation("zz.example/other"), Some("kept"));
        assert_eq!(stored.annotation("absent"), None);
        assert_eq!(stored.datum("token"), Some(&b"token"[..]));
        assert_eq!(stored.datum("x-extra"), Some(&b"x"[..]));
        assert_eq!(stored.datum("user-data"), None);
        let mut whole: Secret = serde_json::from_value(json).expect("a Secret");
        whole.metadata.labels = None;
        whole.metadata.managed_fields = None;
        if let Some(data) = whole.data.as_mut() {
            data.remove("user-data");
        }
        assert_eq!(stored.to_secret(), whole);
        assert!(
            matches!(stored.annotations[0].0, Cow::Borrowed(_)),
            "a well-known key is not copied"
        );
    }
}
