package cached

import (
	"reflect"
	"slices"
	"strings"
	"sync"
	"unique"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Strings that thousands of cached objects repeat (the driver's name, a class, a node, a
// namespace, label and annotation keys and values, finalizers, access modes, phases) are
// decoded afresh into every object. internStrings replaces each by one shared copy
// (unique.Make), so a cache holds it once. The runtime drops a unique.Make copy at the
// next collection once no handle to it is left, whatever still points at its bytes, so a
// process's table (sharedValues) holds the handles: an object decoded after a collection
// then gets the copy the objects before it hold, not a new one.
// Strings that identify one object (names, UIDs, resourceVersions, volume handles) are
// left alone: interning them would add an entry per object to the runtime's table and
// save nothing. Strings are immutable, so sharing one changes nothing an object's reader
// or a DeepCopy sees.

// perObject names the struct fields whose strings are one object's own.
var perObject = map[string]bool{
	"Name": true, "UID": true, "ResourceVersion": true, "VolumeHandle": true, "VolumeName": true,
	"PersistentVolumeName": true, "ClaimName": true, "Message": true, "SnapshotHandle": true,
	"VolumeSnapshotContentName": true, "BoundVolumeSnapshotContentName": true,
}

// skipTypes are walked no further: a Quantity's and a Time's strings are not theirs to
// share (a Quantity caches its own string form), and managedFields are dropped anyway.
var skipTypes = map[reflect.Type]bool{
	reflect.TypeFor[resource.Quantity]():           true,
	reflect.TypeFor[metav1.Time]():                 true,
	reflect.TypeFor[metav1.MicroTime]():            true,
	reflect.TypeFor[[]metav1.ManagedFieldsEntry](): true,
}

// internStrings shares the repeated strings of the object obj points to, and with table
// set, its maps of strings that other objects hold too.
func internStrings(obj any, table *sharedValues) {
	v := reflect.ValueOf(obj)
	if v.Kind() != reflect.Pointer || v.IsNil() {
		return
	}
	internValue(v.Elem(), false, table)
}

var quantityType = reflect.TypeFor[resource.Quantity]()

func internValue(v reflect.Value, own bool, table *sharedValues) {
	if skipTypes[v.Type()] {
		return
	}
	switch v.Kind() {
	case reflect.String:
		if !own && v.CanSet() && v.Len() > 0 {
			v.SetString(table.intern(v.String()))
		}
	case reflect.Pointer:
		if !v.IsNil() {
			internValue(v.Elem(), own, table)
		}
	case reflect.Struct:
		t := v.Type()
		for i := range v.NumField() {
			if f := t.Field(i); f.IsExported() {
				internValue(v.Field(i), perObject[f.Name], table)
			}
		}
	case reflect.Slice:
		for i := range v.Len() {
			internValue(v.Index(i), own, table)
		}
	case reflect.Map:
		// A map is only ever read, never changed: it may already be shared with other
		// objects (an informer can pass an object through its transform twice). A new
		// map takes its place.
		if v.IsNil() || v.Len() == 0 || !v.CanSet() || v.Type().Key().Kind() != reflect.String {
			return
		}
		if elem := v.Type().Elem(); elem.Kind() == reflect.String || elem == quantityType {
			v.Set(table.share(v))
		}
	}
}

// internedCopy is a new map with m's entries, its strings shared (intern). s may be nil.
func (s *sharedValues) internedCopy(m reflect.Value) reflect.Value {
	out := reflect.MakeMapWithSize(m.Type(), m.Len())
	for iter := m.MapRange(); iter.Next(); {
		k := reflect.New(m.Type().Key()).Elem()
		k.SetString(s.intern(iter.Key().String()))
		val := iter.Value()
		if val.Kind() == reflect.String {
			val = reflect.New(m.Type().Elem()).Elem()
			val.SetString(s.intern(iter.Value().String()))
		}
		out.SetMapIndex(k, val)
	}
	return out
}

// sharedValues is a process's table of shared values. It lets cached objects with equal
// maps of strings (labels, annotations, volume attributes: often the same on every object
// of a driver, a class or a node) or of quantities (a claim's requests, a volume's
// capacity) hold one map between them. Cached objects are read-only (an informer's
// contract: a sidecar changes a DeepCopy, which copies the map), and a map's values are read as copies (a Quantity's copy still shares its
// decimal, which no sidecar changes in place), so one object's reader never sees
// another's change. The table keeps at most maxSharedMaps maps, and starts afresh when
// full: maps already shared stay with their objects, and what is common now gets shared
// again. It holds the handles of the strings it shared (intern) the same way, at most
// maxSharedStrings.
type sharedValues struct {
	mu      sync.Mutex
	maps    map[string]reflect.Value // by type and content
	strings map[unique.Handle[string]]struct{}
}

const (
	maxSharedMaps    = 4096
	maxSharedLength  = 16 // entries: larger maps are rarely equal
	maxSharedStrings = 16384
)

func newSharedValues() *sharedValues {
	return &sharedValues{maps: map[string]reflect.Value{}, strings: map[unique.Handle[string]]struct{}{}}
}

// intern is the shared copy of str (unique.Make's), its handle kept by s so that the copy
// outlives the next collection. With s nil (Trim), the copy is shared only until
// then.
func (s *sharedValues) intern(str string) string {
	h := unique.Make(str)
	if s != nil {
		s.mu.Lock()
		if _, ok := s.strings[h]; !ok {
			if len(s.strings) >= maxSharedStrings {
				clear(s.strings)
			}
			s.strings[h] = struct{}{}
		}
		s.mu.Unlock()
	}
	return h.Value()
}

// share is the map shared by objects with m's type and content: a copy of m with shared
// strings (internedCopy), which the table keeps the first time the content is seen. m is
// only read. With s nil, or for a large map, it is a copy of m nobody shares. m's keys are
// strings, its values strings or Quantities.
func (s *sharedValues) share(m reflect.Value) reflect.Value {
	if s == nil || m.Len() > maxSharedLength {
		return s.internedCopy(m)
	}
	entries := make([]string, 0, m.Len())
	for iter := m.MapRange(); iter.Next(); {
		value := iter.Value()
		text := ""
		if q, ok := value.Interface().(resource.Quantity); ok {
			text = q.String() // of a copy: String caches its result in the Quantity
		} else {
			text = value.String()
		}
		entries = append(entries, iter.Key().String()+"\x00"+text)
	}
	slices.Sort(entries)
	content := m.Type().String() + "\x00" + strings.Join(entries, "\x00")
	s.mu.Lock()
	shared, ok := s.maps[content]
	s.mu.Unlock()
	if ok {
		return shared
	}
	shared = s.internedCopy(m)
	s.mu.Lock()
	defer s.mu.Unlock()
	if first, ok := s.maps[content]; ok {
		return first // another transform was quicker
	}
	if len(s.maps) >= maxSharedMaps {
		clear(s.maps)
	}
	s.maps[content] = shared
	return shared
}
